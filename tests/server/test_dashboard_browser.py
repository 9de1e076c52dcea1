"""The dashboard in a real headless browser: Debian's Chromium, driven by selenium through
chromium-driver, against `ft serve` on the bundled Gemma with an API key. The page loads without
the key and asks for it; with it, it shows the model and health; a chat message typed in the chat
box is answered as a stream (the answer's text changes piece by piece); the numbers move (requests
served, the decode tok/s peak, the request's line under "Last requests"). Every wait is on a
condition with a generous deadline; nothing is timed.

A screenshot is written to the test's tmp dir, or to the path in FT_DASHBOARD_SCREENSHOT
(docs/img/dashboard.png is made that way). Without chromium and chromium-driver (`apt-get install
chromium chromium-driver`; .ci/run installs them when it runs as root) the test skips, naming them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait
from serving import ServeProcess, serving

KEY = "dashboard-key"
WAIT_S = 300  # generous: the bundled model on two busy cores
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
SKIP_REASON = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
# Counts the text changes of the assistant's answers: more than one means it came as a stream.
COUNT_UPDATES = """
window.answerUpdates = 0;
new MutationObserver((records) => {
  for (const r of records) if (r.target.closest && r.target.closest('.answer')) window.answerUpdates += 1;
}).observe(document.getElementById('chat-log'), {subtree: true, childList: true, characterData: true});
"""


pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None, reason=SKIP_REASON)  # before the server starts


@pytest.fixture(scope="module")
def bundled_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    flags = ["--num-tokens", "4096", "--max-running-requests", "2", "--enable-cache-report"]
    log = tmp_path_factory.mktemp("dashboard_logs") / "serve.log"
    with serving("gemma3-270m", flags, log, api_key=KEY, deadline_s=900) as proc:
        yield proc


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    assert CHROMIUM is not None and DRIVER is not None
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1440,1160"):
        options.add_argument(arg)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    try:
        yield driver
    finally:
        driver.quit()


def text(driver: webdriver.Chrome, element_id: str) -> str:
    return str(driver.find_element(By.ID, element_id).text)


def number(driver: webdriver.Chrome, element_id: str) -> float:
    value = text(driver, element_id)
    return float(value) if value.replace(".", "", 1).isdigit() else -1.0


def chat(driver: webdriver.Chrome, wait: WebDriverWait, message: str) -> str:
    """Send `message` in the chat box; the answer once its stream ended."""
    done_before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant.done"))
    box = driver.find_element(By.ID, "chat-input")
    box.send_keys(message)
    box.send_keys(Keys.ENTER)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant.done")) > done_before)
    last = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    assert "error" not in (last.get_attribute("class") or ""), last.text
    return str(last.find_element(By.CSS_SELECTOR, ".answer").text)


@pytest.mark.real_model
def test_dashboard_in_a_browser(bundled_server: ServeProcess, browser: webdriver.Chrome, tmp_path: Path) -> None:
    wait = WebDriverWait(browser, WAIT_S, poll_frequency=0.2)
    browser.get(f"{bundled_server.base}/")
    assert browser.title == "FreeToken"
    wait.until(lambda d: d.find_element(By.ID, "keybar").is_displayed())  # the data is behind the key
    browser.find_element(By.ID, "key-input").send_keys(KEY)
    browser.find_element(By.ID, "key-save").click()
    wait.until(lambda d: text(d, "health") == "serving" and text(d, "model") == "gemma3-270m")
    wait.until(lambda d: number(d, "served") >= 0 and "pool" in text(d, "pools").lower())
    served = number(browser, "served")
    max_tokens = browser.find_element(By.ID, "chat-max")
    max_tokens.clear()
    max_tokens.send_keys("32")  # the bundled Gemma is a base model: a short answer is enough
    browser.execute_script(COUNT_UPDATES)
    answer = chat(browser, wait, "What is the capital of France?")
    assert answer.strip(), "the streamed answer is empty"
    assert browser.execute_script("return window.answerUpdates") > 1  # it came in pieces
    wait.until(lambda d: number(d, "served") >= served + 1)
    wait.until(lambda d: number(d, "decode-peak") > 0 and number(d, "prefill-peak") > 0)
    wait.until(lambda d: any(c.text == "chat" for c in d.find_elements(By.CSS_SELECTOR, "#recent tbody td")))
    chat(browser, wait, "And of Italy?")  # a second turn: the conversation's prefix hits the cache
    wait.until(lambda d: number(d, "served") >= served + 2 and text(d, "hit-rate") not in ("-", "0.0%"))
    shot = Path(os.environ.get("FT_DASHBOARD_SCREENSHOT") or tmp_path / "dashboard.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(shot)) and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    bundled_server.assert_balanced_idle()
