"""Take a real-browser screenshot of a running demo page (headless Debian Chromium via Playwright).

    hf-retrace demo --port 7861 &
    python examples/demo_screenshot.py http://127.0.0.1:7861/ docs/demo-screenshot.png "Your prompt" 96
"""
import sys, time
from playwright.sync_api import sync_playwright
FLAGS = ["--no-sandbox","--disable-gpu","--disable-quic","--no-first-run","--disable-background-networking","--disable-component-update","--disable-sync","--disable-dev-shm-usage"]
url, out, prompt, ntok = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
with sync_playwright() as pw:
    b = pw.chromium.launch(executable_path="/usr/bin/chromium", headless=True, args=FLAGS)
    page = b.new_page(viewport={"width": 1280, "height": 900}, device_scale_factor=1)
    page.set_default_timeout(60000)
    page.goto(url, wait_until="domcontentloaded")
    page.locator("#hfr-prompt textarea").fill(prompt)
    num = page.locator("#hfr-max-new-tokens input[type=number]")
    num.fill(ntok); num.press("Enter")
    t = time.time()
    page.locator("#hfr-run").click()
    mid = False
    while True:
        s = page.locator("#hfr-status").inner_text()
        if s.startswith("Done") or s.startswith("⚠"): break
        if not mid and "ReTrace" in s and page.locator("#hfr-drafted-output .hfr-round").count() > 5:
            page.screenshot(path=out.replace(".png", "-streaming.png"), full_page=True); mid = True
        time.sleep(0.5)
        if time.time() - t > 900: break
    print("status:", s, round(time.time()-t,1))
    time.sleep(6)  # let toasts fade
    page.locator("#hfr-acceptance-plot").scroll_into_view_if_needed()
    page.screenshot(path=out, full_page=True)
    print(page.evaluate("() => document.querySelector('#hfr-plain-output .hfr-tokens').innerText") == page.evaluate("() => document.querySelector('#hfr-drafted-output .hfr-tokens').innerText"))
    b.close()
