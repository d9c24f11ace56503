// The kvserve chat page. Dependency-free: plain DOM APIs, fetch and ReadableStream;
// no framework, no CDN, no build step, so it works offline. Answers stream in over
// the /v1/chat/completions SSE stream; Stop aborts the fetch, and the server cancels
// the request when the connection closes. All text (the user's and the model's) is
// rendered by markdown.js, which builds DOM nodes and never uses innerHTML.
//
// Each assistant message carries data-state: streaming, done, stopped or error.
"use strict";

(function () {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "kvserve.apiKey";        // sessionStorage: forgotten with the tab
  const SETTINGS_STORE = "kvserve.settings"; // localStorage: the settings panel
  const SETTING_IDS = ["system", "temperature", "max-tokens", "extra"];
  const state = { model: null, history: [], controller: null };

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function apiHeaders() {
    const headers = { "Content-Type": "application/json" };
    const key = sessionStorage.getItem(KEY_STORE);
    if (key) headers.Authorization = "Bearer " + key;
    return headers;
  }

  async function errorMessage(response) {
    try {
      const body = await response.json();
      return (body.error && body.error.message) || `HTTP ${response.status}`;
    } catch (err) {
      return `HTTP ${response.status}`;
    }
  }

  function updateButtons() {
    const busy = state.controller !== null;
    $("send").hidden = busy;
    $("stop").hidden = !busy;
    $("send").disabled = state.model === null;
  }

  function askForKey(message) {
    state.model = null;
    $("model").textContent = "API key needed";
    $("key-form").hidden = false;
    $("key-error").textContent = message;
    $("api-key").focus();
    updateButtons();
  }

  // GET /v1/models: the model's name, or the key form on a 401.
  async function loadModel() {
    let response;
    try {
      response = await fetch("/v1/models", { headers: apiHeaders() });
    } catch (err) {
      $("model").textContent = "server unreachable";
      return;
    }
    if (response.status === 401) {
      const hadKey = sessionStorage.getItem(KEY_STORE) !== null;
      askForKey(hadKey ? "The server refused that key." : "");
      return;
    }
    if (!response.ok) {
      $("model").textContent = await errorMessage(response);
      return;
    }
    state.model = (await response.json()).data[0].id;
    $("model").textContent = state.model;
    $("key-form").hidden = true;
    updateButtons();
    $("input").focus();
  }

  function scrollToEnd() {
    const main = $("messages");
    main.scrollTop = main.scrollHeight;
  }

  function addMessage(role, text) {
    const node = el("article", "message " + role);
    const label = role === "user" ? "You" : state.model || "assistant";
    node.append(el("div", "role", label), el("div", "content"), el("div", "meta"));
    node.querySelector(".content").append(window.renderMarkdown(text));
    $("messages").append(node);
    scrollToEnd();
    return node;
  }

  // The body of a chat request: the extra fields first, so the ones the page
  // depends on (messages, stream, usage) always hold.
  function requestBody() {
    const extraText = $("extra").value.trim();
    const extra = extraText ? JSON.parse(extraText) : {};
    if (extra === null || typeof extra !== "object" || Array.isArray(extra)) {
      throw new Error("Extra request fields must be a JSON object.");
    }
    const body = { model: state.model, ...extra };
    const temperature = parseFloat($("temperature").value);
    if (!Number.isNaN(temperature) && !("temperature" in extra)) body.temperature = temperature;
    const maxTokens = parseInt($("max-tokens").value, 10);
    if (maxTokens > 0 && !("max_tokens" in extra)) body.max_tokens = maxTokens;
    const system = $("system").value.trim();
    body.messages = (system ? [{ role: "system", content: system }] : []).concat(state.history);
    body.stream = true;
    body.stream_options = { include_usage: true };
    return body;
  }

  // The JSON payloads of an SSE body, up to `data: [DONE]` (comments skipped).
  async function* sseEvents(stream) {
    const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
    let buffer = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value.replace(/\r\n?/g, "\n");
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const data = buffer.slice(0, end).split("\n").filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).trimStart()).join("\n");
        buffer = buffer.slice(end + 2);
        if (data === "[DONE]") return;
        if (data) yield JSON.parse(data);
      }
    }
  }

  function usageLine(usage, seconds, finish) {
    const parts = [];
    if (usage) {
      parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
      if (seconds > 0) parts.push(`${(usage.completion_tokens / seconds).toFixed(1)} tok/s`);
    }
    parts.push(`${seconds.toFixed(1)} s`);
    if (finish === "length") parts.push("cut at max tokens");
    return parts.join(" · ");
  }

  // Streams one answer into `answer`, its text so far kept in `progress.text`.
  async function streamAnswer(body, answer, controller, progress) {
    const content = answer.querySelector(".content");
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: apiHeaders(), body: JSON.stringify(body),
      signal: controller.signal,
    });
    if (!response.ok) {
      const message = await errorMessage(response);
      if (response.status === 401) askForKey("The server refused the key.");
      throw new Error(message);
    }
    let usage = null;
    let finish = null;
    for await (const event of sseEvents(response.body)) {
      if (event.error) throw new Error(event.error.message);
      const choice = event.choices && event.choices[0];
      if (choice && choice.delta && choice.delta.content) {
        progress.text += choice.delta.content;
        content.replaceChildren(window.renderMarkdown(progress.text));
        scrollToEnd();
      }
      if (choice && choice.finish_reason) finish = choice.finish_reason;
      if (event.usage) usage = event.usage;
    }
    return { usage, finish };
  }

  async function send() {
    const text = $("input").value;
    if (!text.trim() || state.controller !== null || state.model === null) return;
    state.history.push({ role: "user", content: text });
    let body;
    try {
      body = requestBody();
    } catch (err) {
      state.history.pop();
      $("settings").hidden = false;
      alertIn(addMessage("assistant", ""), "Settings: " + err.message);
      return;
    }
    $("input").value = "";
    resizeInput();
    addMessage("user", text);
    const answer = addMessage("assistant", "");
    answer.dataset.state = "streaming";
    const controller = new AbortController();
    state.controller = controller;
    updateButtons();
    const started = performance.now();
    const progress = { text: "" };
    try {
      const result = await streamAnswer(body, answer, controller, progress);
      answer.dataset.state = "done";
      if (state.controller === controller) {
        state.history.push({ role: "assistant", content: progress.text });
      }
      const seconds = (performance.now() - started) / 1000;
      answer.querySelector(".meta").textContent = usageLine(result.usage, seconds, result.finish);
    } catch (err) {
      const stopped = err.name === "AbortError";
      answer.dataset.state = stopped ? "stopped" : "error";
      if (stopped) {
        answer.querySelector(".meta").textContent = "stopped";
        if (progress.text && state.controller === controller) {
          state.history.push({ role: "assistant", content: progress.text });
        }
      } else {
        if (state.controller === controller) state.history.pop();
        alertIn(answer, err.message);
      }
    } finally {
      if (state.controller === controller) state.controller = null;
      updateButtons();
    }
  }

  function alertIn(answer, message) {
    answer.dataset.state = "error";
    answer.querySelector(".content").append(el("p", "error", message));
  }

  function newChat() {
    if (state.controller) state.controller.abort();
    state.controller = null;
    state.history = [];
    $("messages").replaceChildren();
    updateButtons();
    $("input").focus();
  }

  function resizeInput() {
    const input = $("input");
    input.style.height = "auto";
    // scrollHeight leaves out the borders, which border-box heights include
    input.style.height = input.scrollHeight + input.offsetHeight - input.clientHeight + "px";
  }

  function restoreSettings() {
    let saved = {};
    try {
      saved = JSON.parse(localStorage.getItem(SETTINGS_STORE) || "{}");
    } catch (err) { /* a damaged entry: start from the defaults */ }
    for (const id of SETTING_IDS) {
      if (typeof saved[id] === "string") $(id).value = saved[id];
      $(id).addEventListener("input", () => {
        const values = Object.fromEntries(SETTING_IDS.map((k) => [k, $(k).value]));
        localStorage.setItem(SETTINGS_STORE, JSON.stringify(values));
      });
    }
  }

  function wire() {
    $("composer").addEventListener("submit", (e) => { e.preventDefault(); send(); });
    $("input").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        send();
      }
    });
    $("input").addEventListener("input", resizeInput);
    $("stop").addEventListener("click", () => state.controller && state.controller.abort());
    $("new-chat").addEventListener("click", newChat);
    $("settings-toggle").addEventListener("click", () => {
      const panel = $("settings");
      panel.hidden = !panel.hidden;
      $("settings-toggle").setAttribute("aria-expanded", String(!panel.hidden));
    });
    $("key-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const key = $("api-key").value.trim();
      if (key) sessionStorage.setItem(KEY_STORE, key);
      else sessionStorage.removeItem(KEY_STORE);
      $("api-key").value = "";
      loadModel();
    });
  }

  restoreSettings();
  wire();
  updateButtons();
  loadModel();
})();
