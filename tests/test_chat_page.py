"""The chat page at `/`, in a real headless Chromium (Debian's `chromium`, driven by playwright).

Types a prompt, sees the answer stream in piece by piece and the tokens/s figure appear, and
saves a screenshot under the test's tmp dir. Skipped only where no Chromium is installed.
"""

import shutil

import pytest

pytest.importorskip("fastapi")
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright package is not installed")


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="no chromium browser installed (apt-get install chromium)")


def test_chat_page_streams_an_answer(server, tmp_path):
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True, args=FLAGS,
            viewport={"width": 1100, "height": 700},
        )
        try:
            page = browser.new_page()
            page.goto(server.url + "/")
            page.wait_for_function("document.getElementById('model').textContent.includes('context')")
            page.fill("#max_tokens", "120")
            page.fill("#temperature", "0.8")
            page.fill("#seed", "3")
            page.fill("#prompt", "def parse(text):")
            # The page's own record of the answer as it grows: a mutation observer's callback runs
            # once per task that changed the log (a network read of the stream, at the earliest),
            # so a streamed answer is recorded at several lengths however fast the model is, and
            # an answer that arrived in one piece at one length.
            page.evaluate("""() => {
                window.answerLengths = [];
                new MutationObserver(() => {
                    const answers = document.querySelectorAll('.msg.assistant');
                    if (answers.length) window.answerLengths.push(answers[answers.length - 1].textContent.length);
                }).observe(document.getElementById('log'), {childList: true, subtree: true, characterData: true});
            }""")
            page.click("#send")
            answer = page.locator(".msg.assistant").last
            page.wait_for_function(
                "[...document.querySelectorAll('#log .msg')].pop().dataset.state !== 'streaming'", timeout=120_000)
            assert answer.get_attribute("data-state") == "done", answer.text_content()
            final = answer.text_content()
            assert final.strip()
            lengths = page.evaluate("window.answerLengths")
            seen = sorted(set(n for n in lengths if 0 < n < len(final)))
            assert len(seen) >= 2, f"no partial answer was seen before the end: {lengths[:20]}..."
            assert float(page.text_content("#speed")) > 0
            assert "generated tokens" in page.text_content("#counts")
            assert page.locator(".msg.user").last.text_content() == "def parse(text):"
            shot = tmp_path / "chat-page.png"
            page.screenshot(path=str(shot))
            assert shot.stat().st_size > 10_000
            print(f"screenshot: {shot}")
        finally:
            browser.close()
