"""The built-in chat page (server/web/) in a real headless Chromium, driven by
selenium, against the real server (the shared `server` fixture: an API key, a
256-block KV cache of 16-token pages).

The browser is Debian's `chromium` with `chromium-driver`; `make test` installs them
when it runs as root. Without them the browser tests are skipped, except under CI
(`CI` set), where they fail: there they must run. One test run also writes
docs/web-ui.png, a screenshot of a conversation.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from server.app import create_app
from server.cli import parse_settings
from server.settings import ServerSettings
from tests.server.conftest import MODEL, REPO_ROOT, scrape

SCREENSHOT = REPO_ROOT / "docs" / "web-ui.png"
RUNNING = "vllm:num_requests_running{}"
XSS = "<img src=x onerror=window.__pwned=1>"
# Structured output makes the model itself answer with markup, deterministically.
XSS_FORMAT = {"response_format": {"type": "json_schema", "json_schema": {
    "name": "tag", "schema": {"type": "object", "properties": {"html": {"enum": [XSS]}},
                              "required": ["html"], "additionalProperties": False}}}}


def test_page_and_its_files_need_no_key(server):
    page = httpx.get(f"{server.base_url}/", timeout=10)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name, media in [("chat.js", "text/javascript"), ("markdown.js", "text/javascript"),
                        ("chat.css", "text/css")]:
        asset = httpx.get(f"{server.base_url}/web/{name}", timeout=10)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(media)
    assert httpx.get(f"{server.base_url}/web/app.py", timeout=10).status_code == 404
    assert httpx.get(f"{server.base_url}/v1/models", timeout=10).status_code == 401


def test_no_web_ui_leaves_the_page_out():
    assert parse_settings([], environ={}).web_ui is True
    assert parse_settings(["--no-web-ui"], environ={}).web_ui is False
    # The routes answer without the lifespan (no model is loaded for them).
    for web_ui, status in [(True, 200), (False, 404)]:
        client = TestClient(create_app(ServerSettings(web_ui=web_ui)),
                            base_url="http://127.0.0.1")
        assert client.get("/").status_code == status
        assert client.get("/web/chat.js").status_code == status


# --- in the browser ---------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    chromium, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        reason = ("no chromium/chromedriver: install Debian's chromium and chromium-driver "
                  "(`make test` does as root)")
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                 "--disable-gpu", "--window-size=1000,760", "--force-color-profile=srgb"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def wait_for(driver, condition, timeout=60, message=""):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(
        lambda d: condition(), message)


def by_id(driver, element_id):
    return driver.find_element("id", element_id)


def open_chat(driver, server):
    """Load the page, enter the key when it asks, and wait for the model's name."""
    driver.get(f"{server.base_url}/")
    wait_for(driver, lambda: by_id(driver, "model").text != "connecting...")
    if by_id(driver, "key-form").is_displayed():
        by_id(driver, "api-key").send_keys(server.api_key + "\n")
    wait_for(driver, lambda: by_id(driver, "model").text == MODEL)


def configure(driver, temperature="0", max_tokens="64", extra=""):
    """Fill the settings panel the way typing would (its input events save it)."""
    driver.execute_script("""
        for (const [id, value] of Object.entries(arguments[0])) {
          const field = document.getElementById(id);
          field.value = value;
          field.dispatchEvent(new Event('input'));
        }""", {"temperature": temperature, "max-tokens": max_tokens, "extra": extra})


def send(driver, text):
    from selenium.webdriver.common.keys import Keys

    by_id(driver, "input").send_keys(text, Keys.ENTER)


def last_answer(driver):
    return driver.find_elements("css selector", ".message.assistant")[-1]


def wait_answer(driver, state="done", timeout=60):
    wait_for(driver, lambda: last_answer(driver).get_attribute("data-state") == state,
             timeout, f"the answer never reached {state}")
    return last_answer(driver)


def test_the_page_asks_for_the_key(browser, server):
    browser.get(f"{server.base_url}/")
    browser.execute_script("sessionStorage.clear()")
    browser.refresh()
    wait_for(browser, lambda: by_id(browser, "key-form").is_displayed())
    assert by_id(browser, "model").text == "API key needed"
    assert not by_id(browser, "send").is_enabled()
    by_id(browser, "api-key").send_keys("wrong-key\n")
    wait_for(browser, lambda: "refused" in by_id(browser, "key-error").text)
    by_id(browser, "api-key").send_keys(server.api_key + "\n")
    wait_for(browser, lambda: by_id(browser, "model").text == MODEL)
    assert not by_id(browser, "key-form").is_displayed()
    configure(browser, max_tokens="8")
    send(browser, "Hello!")
    answer = wait_answer(browser)
    assert answer.find_element("css selector", ".content").text.strip()
    assert "completion tokens" in answer.find_element("css selector", ".meta").text


def test_an_answer_streams_in(browser, server):
    from selenium.webdriver.common.keys import Keys

    open_chat(browser, server)
    by_id(browser, "new-chat").click()
    configure(browser, max_tokens="160")
    by_id(browser, "input").send_keys("Write a Python function that adds two numbers.",
                                      Keys.SHIFT, Keys.ENTER, Keys.SHIFT,
                                      "Explain it briefly.")
    assert "\n" in by_id(browser, "input").get_attribute("value")
    assert not browser.find_elements("css selector", ".message")   # Shift+Enter: no send
    by_id(browser, "input").send_keys(Keys.ENTER)
    lengths = set()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        answer = last_answer(browser)
        state = answer.get_attribute("data-state")
        lengths.add(len(answer.find_element("css selector", ".content").text))
        if state != "streaming":
            break
    assert state == "done"
    assert len(lengths - {0}) >= 3, f"the answer did not grow in steps: {sorted(lengths)}"
    user = browser.find_elements("css selector", ".message.user")[-1].text
    assert "adds two numbers." in user and "Explain it briefly." in user
    assert "completion tokens" in answer.find_element("css selector", ".meta").text
    browser.save_screenshot(str(SCREENSHOT))


def test_stop_cancels_the_request(browser, server):
    open_chat(browser, server)
    by_id(browser, "new-chat").click()
    configure(browser, max_tokens="460")
    send(browser, "Write a long story about a dragon who learns to bake bread.")
    wait_for(browser, lambda: len(last_answer(browser).text) > 40)
    assert scrape(server.base_url)[RUNNING] == 1
    by_id(browser, "stop").click()
    answer = wait_answer(browser, "stopped", timeout=10)
    wait_for(browser, lambda: scrape(server.base_url)[RUNNING] == 0, timeout=10,
             message="the stopped request is still running")
    assert by_id(browser, "send").is_displayed() and not by_id(browser, "stop").is_displayed()
    shown = answer.find_element("css selector", ".content").text
    time.sleep(0.3)
    assert answer.find_element("css selector", ".content").text == shown


def test_markup_in_messages_is_shown_as_text(browser, server):
    open_chat(browser, server)
    by_id(browser, "new-chat").click()
    browser.execute_script("window.__pwned = undefined")
    configure(browser, max_tokens="64", extra=json.dumps(XSS_FORMAT))
    send(browser, f"Show {XSS} and <script>window.__pwned=2</script> as they are.")
    answer = wait_answer(browser)
    configure(browser)
    assert XSS in answer.find_element("css selector", ".content").text     # the model's
    user = browser.find_elements("css selector", ".message.user")[-1].text
    assert XSS in user and "<script>window.__pwned=2</script>" in user
    assert browser.find_elements("tag name", "img") == []
    scripts = browser.find_elements("tag name", "script")
    assert [s.get_attribute("src").rsplit("/", 1)[-1] for s in scripts] == \
        ["markdown.js", "chat.js"]
    assert browser.execute_script("return window.__pwned") is None


def test_markdown_is_rendered_as_elements(browser, server):
    open_chat(browser, server)
    by_id(browser, "new-chat").click()
    browser.execute_script("""
        const out = document.createElement('div');
        out.id = 'md';
        out.append(window.renderMarkdown(arguments[0]));
        document.body.append(out);""",
        "# Title\n\n**bold** and *it* and `x < y`\n\n```python\nprint('<b>')\n```\n"
        "- one\n- two **2**\n\n1. first\n2. second\n\nsnake_case_name")
    md = by_id(browser, "md")
    tags = browser.execute_script(
        "return [...arguments[0].querySelectorAll('*')].map(e => e.tagName.toLowerCase())", md)
    assert tags == ["h3", "p", "strong", "em", "code", "pre", "span", "code",
                    "ul", "li", "li", "strong", "ol", "li", "li", "p"]
    assert md.find_element("css selector", "pre code").text == "print('<b>')"
    assert md.find_elements("tag name", "p")[-1].text == "snake_case_name"
