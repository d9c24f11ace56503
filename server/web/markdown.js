// A tiny, safe markdown renderer for the kvserve chat page. Dependency-free.
//
// renderMarkdown(text) returns a DocumentFragment built only with createElement,
// createTextNode and textContent: model text never passes through innerHTML, so
// "<img src=x onerror=...>" in an answer is shown as those characters and never
// becomes an element. Supported: fenced code blocks (``` or ~~~, with a language
// label), headings, bullet and numbered lists, paragraphs (single newlines kept),
// inline code, **bold** / __bold__, *italic* / _italic_. Links stay plain text.
// An unclosed fence (an answer still streaming) renders as code up to the end.
"use strict";

(function () {
  const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const ITEM = /^\s*([-*+]|\d{1,9}[.)])\s+(.*)$/;
  // Inline spans, first match wins: code, then bold, then italic. Underscores
  // inside words (snake_case, window.__name) are not emphasis.
  const INLINE = /(`+)([\s\S]+?)\1|\*\*(?=\S)([\s\S]+?)\*\*|(?<![\w])__(?=\S)([\s\S]+?)__(?![\w])|\*(?=[^\s*])([^*]+?)\*|(?<![\w])_(?=[^\s_])([^_]+?)_(?![\w])/g;

  function el(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  // Appends `text` to `parent` with its inline spans as elements.
  function appendInline(parent, text) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) parent.append(document.createTextNode(text.slice(last, m.index)));
      if (m[1] !== undefined) {
        const code = el("code");
        code.textContent = m[2];
        parent.append(code);
      } else {
        const span = el(m[3] !== undefined || m[4] !== undefined ? "strong" : "em");
        appendInline(span, m[3] ?? m[4] ?? m[5] ?? m[6]);
        parent.append(span);
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) parent.append(document.createTextNode(text.slice(last)));
  }

  // A fenced block starting at lines[i]: [the <pre> element, index after the fence].
  function codeBlock(lines, i) {
    const [, fence, lang] = lines[i].match(FENCE);
    const body = [];
    let j = i + 1;
    while (j < lines.length && !lines[j].trim().startsWith(fence)) body.push(lines[j++]);
    const pre = el("pre");
    if (lang) {
      const label = el("span", "lang");
      label.textContent = lang;
      pre.append(label);
    }
    const code = el("code");
    code.textContent = body.join("\n");
    pre.append(code);
    return [pre, j + 1];
  }

  // A list starting at lines[i]: [the <ul>/<ol> element, index after it]. Lines
  // that are neither items nor blank continue the item above.
  function list(lines, i) {
    const ordered = /\d/.test(lines[i].match(ITEM)[1]);
    const node = el(ordered ? "ol" : "ul");
    let item = null;
    let text = [];
    const flush = () => { if (item) { appendInline(item, text.join("\n")); node.append(item); } };
    for (; i < lines.length; i++) {
      const m = lines[i].match(ITEM);
      if (m && /\d/.test(m[1]) === ordered) {
        flush();
        item = el("li");
        text = [m[2]];
        if (ordered && node.children.length === 0 && parseInt(m[1], 10) !== 1) {
          node.start = parseInt(m[1], 10);
        }
      } else if (lines[i].trim() && !FENCE.test(lines[i]) && !HEADING.test(lines[i]) && !m) {
        text.push(lines[i].trim());
      } else {
        break;
      }
    }
    flush();
    return [node, i];
  }

  function renderMarkdown(text) {
    const out = document.createDocumentFragment();
    const lines = String(text).replace(/\r\n?/g, "\n").split("\n");
    let para = [];
    const flushPara = () => {
      if (para.length === 0) return;
      const p = el("p");
      appendInline(p, para.join("\n"));
      out.append(p);
      para = [];
    };
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      let block = null;
      if (FENCE.test(line)) {
        [block, i] = codeBlock(lines, i);
      } else if (ITEM.test(line)) {
        [block, i] = list(lines, i);
      } else if (HEADING.test(line)) {
        const [, hashes, title] = line.match(HEADING);
        block = el("h" + Math.min(6, hashes.length + 2));
        appendInline(block, title);
        i++;
      } else if (!line.trim()) {
        flushPara();
        i++;
        continue;
      } else {
        para.push(line);
        i++;
        continue;
      }
      flushPara();
      out.append(block);
    }
    flushPara();
    return out;
  }

  window.renderMarkdown = renderMarkdown;
})();
