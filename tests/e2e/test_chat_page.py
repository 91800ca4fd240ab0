"""The chat page at / of a real `dsv4 serve --http` on the embedded model, in a real headless
Chromium driven by WebDriver (selenium and Debian's chromedriver, which scripts/browser.sh
installs): a streamed conversation that is the API's own answer and survives a reload, the stop
button ending the request in the engine, thinking and tool calls shown and model text never
taken for HTML, a screenshot looked at; with --api-key, the key asked for and sent; and the
page under the same Host and Origin rules as the API."""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Iterator

import pytest

from tests.e2e.util import Daemon, env_for, free_port, short_dir, wait_until

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(f"no {CHROMIUM} and {CHROMEDRIVER}: scripts/browser.sh installs them (as root, with apt-get)",
                allow_module_level=True)
pytest.importorskip("selenium", reason="the test extra's selenium drives the browser (scripts/venv.sh test)")
pytest.importorskip("PIL", reason="the test extra's pillow reads the screenshot")

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402
from selenium.webdriver.support.ui import WebDriverWait  # noqa: E402

from PIL import Image, ImageStat  # noqa: E402

import dsv4  # noqa: E402

KEY = "sk-chat-page"
REBIND = "rebind.example"  # the browser resolves it to 127.0.0.1, as a DNS-rebinding page would
WIDTH, HEIGHT = 1200, 800


class Server:
    def __init__(self, key: str | None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = env_for(**({"DSV4_API_KEY": key} if key else {}))
        if not key:
            env.pop("DSV4_API_KEY", None)
        self.daemon = Daemon(dsv4.DEFAULT_MODEL, "--http", f"127.0.0.1:{self.port}", env=env)

    def request(self, method: str, path: str, body: Any = None, **headers: str) -> tuple[int, dict, str]:
        c = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            data = json.dumps(body).encode() if body is not None else None
            c.request(method, path, body=data, headers=headers)
            r = c.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read().decode()
        finally:
            c.close()

    def metric(self, name: str) -> float:
        text = self.request("GET", "/metrics", Authorization=f"Bearer {KEY}")[2]
        return sum(float(m) for m in re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M))


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[Server, Server]]:
    """A keyless server and one with --api-key (in DSV4_API_KEY), started side by side."""
    open_, keyed = Server(None), Server(KEY)
    try:
        for s in (open_, keyed):
            ok = wait_until(lambda: s.daemon.proc.poll() is None and _status(s, "/health") == 200, timeout=90)
            assert ok, s.daemon.log.read_text()
        yield open_, keyed
    finally:
        open_.daemon.cleanup()
        keyed.daemon.cleanup()


def _status(s: Server, path: str) -> int:
    try:
        return s.request("GET", path)[0]
    except OSError:
        return 0


@pytest.fixture(scope="module")
def server(servers: tuple[Server, Server]) -> Server:
    return servers[0]


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    profile = short_dir()
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", "--force-device-scale-factor=1",
                f"--host-resolver-rules=MAP {REBIND} 127.0.0.1"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)  # a driver path: no selenium-manager
    try:
        driver.set_script_timeout(30)
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


# ---------------------------------------------------------------------- helpers
def _wait(driver: WebDriver, cond: Any, timeout: float = 30, what: str = "") -> Any:
    return WebDriverWait(driver, timeout, poll_frequency=0.05).until(lambda d: cond(), message=what)


def _open(driver: WebDriver, url: str, model: str | None = "tiny-shakespeare") -> None:
    driver.get(url + "/")
    if model:
        _wait(driver, lambda: driver.find_element(By.ID, "model").text == model, what="the model's name")


def _set(driver: WebDriver, id_: str, value: str) -> None:
    field = driver.find_element(By.ID, id_)
    field.clear()
    field.send_keys(value)


def _say(driver: WebDriver, text: str) -> None:
    _set(driver, "prompt", text)
    driver.find_element(By.ID, "prompt").send_keys(Keys.ENTER)


def _answers(driver: WebDriver) -> list[dict[str, str]]:
    """Each assistant message of the page as {text, meta, error} ('' where absent)."""
    return driver.execute_script("""
        return [...document.querySelectorAll('#messages .msg.assistant')].map(m => ({
            text: m.querySelector(':scope > .text')?.textContent ?? '',
            meta: m.querySelector(':scope > .meta')?.textContent ?? '',
            error: m.querySelector(':scope > .error')?.textContent ?? ''}));""")


def _last(driver: WebDriver) -> dict[str, str]:
    answers = _answers(driver)
    return answers[-1] if answers else {"text": "", "meta": "", "error": ""}


def _idle(driver: WebDriver) -> bool:
    return not driver.find_element(By.ID, "stop").is_displayed() and driver.find_element(By.ID, "send").is_enabled()


def _errors(driver: WebDriver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


# ---------------------------------------------------------------------- the keyless server
def test_a_streamed_conversation_is_the_apis_answer_and_survives_a_reload(server: Server, browser: WebDriver):
    _open(browser, server.url)
    browser.find_element(By.ID, "new-chat").click()
    _set(browser, "temperature", "0")
    _set(browser, "max_tokens", "24")
    _say(browser, "ROMEO: What light")
    _wait(browser, lambda: _idle(browser) and "length" in _last(browser)["meta"], what="the answer")
    answer = _last(browser)
    assert answer["text"] and "24 tokens" in answer["meta"] and not answer["error"], answer
    # exactly what the API answers the same conversation (greedy): no event lost or doubled
    status, _, body = server.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "ROMEO: What light"}], "temperature": 0, "max_tokens": 24},
        **{"Content-Type": "application/json"})
    assert status == 200 and json.loads(body)["choices"][0]["message"]["content"] == answer["text"]
    # a second turn sends the first back: the conversation goes on
    _say(browser, "JULIET: Who is there")
    _wait(browser, lambda: _idle(browser) and len(_answers(browser)) == 2 and _last(browser)["meta"],
          what="the second answer")
    before = browser.find_element(By.ID, "messages").text
    browser.refresh()
    _wait(browser, lambda: browser.find_element(By.ID, "model").text == "tiny-shakespeare")
    assert browser.find_element(By.ID, "messages").text == before
    assert browser.find_element(By.ID, "max_tokens").get_attribute("value") == "24"
    assert [m.text for m in browser.find_elements(By.CSS_SELECTOR, ".msg.user .text")] == [
        "ROMEO: What light", "JULIET: Who is there"]
    assert _errors(browser) == []  # no script error, nothing the Content-Security-Policy blocked


def test_stop_ends_the_answer_and_the_request_in_the_engine(server: Server, browser: WebDriver):
    _open(browser, server.url)
    browser.find_element(By.ID, "new-chat").click()
    _set(browser, "max_tokens", "4000")  # about a minute of the embedded model here: stopped long before
    _say(browser, "ROMEO:")
    _wait(browser, lambda: len(_last(browser)["text"]) > 40, what="streamed text")
    assert browser.find_element(By.ID, "stop").is_displayed() and not _last(browser)["meta"]
    assert server.metric("vllm:num_requests_running") == 1
    browser.find_element(By.ID, "stop").click()
    _wait(browser, lambda: _idle(browser), what="the stop")
    stopped = _last(browser)
    assert stopped["meta"].startswith("stopped") and not stopped["error"], stopped
    assert wait_until(lambda: server.metric("vllm:num_requests_running") + server.metric(
        "vllm:num_requests_waiting") == 0, timeout=10), "the request still runs in the engine"
    tokens = server.metric("vllm:generation_tokens_total")
    time.sleep(1.0)
    assert server.metric("vllm:generation_tokens_total") == tokens < 4000
    assert _last(browser) == stopped  # nothing came after the stop
    browser.refresh()  # the partial answer is kept, marked stopped
    _wait(browser, lambda: _last(browser) == stopped, what="the stopped answer after a reload")


def test_thinking_tool_calls_and_markup_are_shown_as_text(server: Server, browser: WebDriver):
    _open(browser, server.url)
    markup = '<img src=x onerror="window.pwned = 1"><b>bold</b>'
    saved = {"settings": {}, "messages": [
        {"role": "user", "content": markup},
        {"role": "assistant", "model": "m", "reasoning": "the user wants <script>alert(1)</script>",
         "content": "Calling it.", "tool_calls": [{"name": "get_weather", "arguments": '{"city": "<Paris>"}'}],
         "meta": "tool_calls"}]}
    browser.execute_script("localStorage.setItem('dsv4-chat', arguments[0])", json.dumps(saved))
    browser.refresh()
    _wait(browser, lambda: browser.find_elements(By.CSS_SELECTOR, ".tool-call"), what="the stored conversation")
    assert browser.find_element(By.CSS_SELECTOR, ".msg.user .text").get_attribute("textContent") == markup
    details = browser.find_element(By.CSS_SELECTOR, ".msg.assistant details.reasoning")
    assert details.get_attribute("open") is None  # folded
    assert details.find_element(By.TAG_NAME, "summary").text == "Thinking"
    details.find_element(By.TAG_NAME, "summary").click()
    assert details.find_element(By.CLASS_NAME, "text").text == "the user wants <script>alert(1)</script>"
    call = browser.find_element(By.CSS_SELECTOR, ".tool-call")
    assert "get_weather" in call.text and '{"city": "<Paris>"}' in call.text
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages img, #messages b, #messages script")
    assert browser.execute_script("return window.pwned") is None
    # thinking on reaches the server: the embedded model has no thinking mode, and says so
    browser.find_element(By.ID, "new-chat").click()
    _set(browser, "max_tokens", "4")
    browser.find_element(By.ID, "thinking").click()
    try:
        _say(browser, "Hello")
        _wait(browser, lambda: _idle(browser) and _last(browser)["error"], what="the 400")
        assert _last(browser)["error"].startswith("400: ") and "thinking" in _last(browser)["error"]
    finally:
        browser.find_element(By.ID, "thinking").click()


def test_a_screenshot_shows_the_page(server: Server, browser: WebDriver, tmp_path: Path):
    _open(browser, server.url)
    browser.find_element(By.ID, "new-chat").click()
    _set(browser, "max_tokens", "40")
    _say(browser, "KING HENRY: Once more unto the breach")
    _wait(browser, lambda: _idle(browser) and _last(browser)["meta"], what="the answer")
    path = tmp_path / "chat-page.png"
    assert browser.save_screenshot(str(path))
    img = Image.open(path)
    img.load()
    view = browser.execute_script("return [innerWidth, innerHeight, devicePixelRatio]")
    assert img.format == "PNG" and img.size == (round(view[0] * view[2]), round(view[1] * view[2]))
    assert img.size[0] >= WIDTH * 0.9, img.size
    rgb = img.convert("RGB")
    assert rgb.getpixel((3, 3)) == (0x1f, 0x2a, 0x44)  # the header: the stylesheet was applied
    box = browser.execute_script("const r = document.getElementById('messages').getBoundingClientRect();"
                                 "return [r.left, r.top, r.right, r.bottom]")
    chat = rgb.crop(tuple(round(v * view[2]) for v in box))
    colors = chat.getcolors(1 << 20)
    background = max(colors)[0] / (chat.width * chat.height)
    assert len(colors) > 50 and background < 0.97, (len(colors), background)  # text and bubbles, not blank
    var = ImageStat.Stat(chat.convert("L")).var[0]
    assert var > 100, var
    print(f"\nscreenshot {path}: {img.size[0]}x{img.size[1]}, {len(colors)} colours in the chat area, "
          f"{background:.0%} of it background, grey variance {var:.0f}")


# ---------------------------------------------------------------------- the key, Host and Origin
def test_with_an_api_key_the_page_loads_and_asks_for_it(servers: tuple[Server, Server], browser: WebDriver):
    keyed = servers[1]
    status, headers, _ = keyed.request("GET", "/")
    assert status == 200 and headers["content-type"].startswith("text/html")  # the page is public
    assert keyed.request("GET", "/v1/models")[0] == 401  # the API is not
    browser.get_log("browser")  # what earlier tests logged
    _open(browser, keyed.url, model=None)
    label = browser.find_element(By.ID, "model")
    _wait(browser, lambda: label.text.startswith("401: "), what="the models' 401")
    assert "invalid or missing API key" in label.text and "error" in label.get_attribute("class")
    _set(browser, "max_tokens", "8")
    _say(browser, "To be")
    _wait(browser, lambda: _idle(browser) and _last(browser)["error"], what="the 401")
    assert _last(browser)["error"].startswith("401: invalid or missing API key")
    _set(browser, "api-key", "wrong")
    _say(browser, "To be")
    _wait(browser, lambda: _idle(browser) and len(_answers(browser)) == 2, what="the second 401")
    assert _last(browser)["error"].startswith("401: ")
    _set(browser, "api-key", KEY)
    _say(browser, "To be")
    _wait(browser, lambda: _idle(browser) and len(_answers(browser)) == 3, what="the answer with the key")
    assert _last(browser)["text"] and "length" in _last(browser)["meta"] and not _last(browser)["error"]
    assert label.text == "tiny-shakespeare"
    browser.refresh()  # the key stays in the tab
    _wait(browser, lambda: browser.find_element(By.ID, "model").text == "tiny-shakespeare")
    assert browser.find_element(By.ID, "api-key").get_attribute("value") == KEY
    assert browser.execute_script("return localStorage.getItem('dsv4-chat')").count(KEY) == 0
    assert all("401" in e for e in _errors(browser))  # the refused fetches, and nothing else


@pytest.mark.parametrize("path", ["/", "/static/chat.js", "/static/chat.css"])
def test_the_page_is_under_the_apis_host_and_origin_rules(server: Server, path: str):
    status, headers, body = server.request("GET", path)
    assert status == 200 and body and "default-src 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff"
    for refused in ({"Host": "evil.example"}, {"Host": f"{REBIND}:{server.port}"}, {"Origin": "http://evil.example"},
                    {"Origin": "null"}):
        page, api = server.request("GET", path, **refused), server.request("GET", "/v1/models", **refused)
        assert page[0] in (400, 403) and (page[0], page[2]) == (api[0], api[2]), refused
        assert "access-control-allow-origin" not in page[1]
    assert server.request("GET", path, Origin=server.url)[0] == 200  # its own origin


def test_a_rebinding_browser_is_refused_the_page(server: Server, browser: WebDriver):
    """The browser asks for the page under another name that resolves to 127.0.0.1."""
    browser.get(f"http://{REBIND}:{server.port}/")
    assert "is not this server's address" in browser.find_element(By.TAG_NAME, "body").text
    assert not browser.find_elements(By.ID, "messages")
