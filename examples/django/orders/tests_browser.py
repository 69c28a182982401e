"""The outbox admin in a real browser: headless Chromium driven by Selenium against
Django's live server. Skipped unless Selenium, Chromium and chromedriver are installed
(Debian: ``apt-get install chromium chromium-driver``; .ci/run installs them)."""

import os
import shutil
import unittest

from django.contrib.auth.models import User
from django.contrib.staticfiles.testing import StaticLiveServerTestCase

from outbox.contrib.django.models import OutboxEvent, Status

from .tests import make_row

CHROMEDRIVER = os.environ.get("CHROMEDRIVER") or shutil.which("chromedriver")
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")

try:
    from selenium import webdriver
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import Select, WebDriverWait
except ImportError:  # pragma: no cover
    webdriver = None


@unittest.skipUnless(webdriver and CHROMEDRIVER and CHROMIUM, "needs selenium, chromium and chromedriver")
class AdminInBrowserTests(StaticLiveServerTestCase):
    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                    "--window-size=1400,1000"):
            options.add_argument(arg)
        cls.browser = webdriver.Chrome(service=webdriver.ChromeService(executable_path=CHROMEDRIVER),
                                       options=options)
        cls.browser.implicitly_wait(10)

    @classmethod
    def tearDownClass(cls):
        cls.browser.quit()
        super().tearDownClass()

    def test_a_user_finds_a_dead_event_reads_its_error_and_requeues_it(self):
        User.objects.create_superuser("admin", "admin@example.com", "pw-for-tests")
        pending = make_row(Status.PENDING)
        dead = make_row(Status.DEAD, error="unroutable: no queue bound for routing key 'orders.created'", attempts=10)
        b = self.browser
        b.get(f"{self.live_server_url}/admin/login/?next=/admin/outbox/outboxevent/")
        b.find_element(By.NAME, "username").send_keys("admin")
        b.find_element(By.NAME, "password").send_keys("pw-for-tests")
        b.find_element(By.CSS_SELECTOR, "input[type=submit]").click()
        # Every navigation is awaited explicitly: a loaded machine may be slow to render.
        wait = WebDriverWait(b, 60)
        wait.until(EC.title_contains("outbox event"))
        # The status filter: only dead rows, each with its error.
        b.find_element(By.LINK_TEXT, "dead").click()
        wait.until(EC.url_contains("status__exact=4"))
        wait.until(EC.presence_of_element_located((By.ID, "result_list")))
        rows = b.find_elements(By.CSS_SELECTOR, "#result_list tbody tr")
        self.assertEqual(len(rows), 1)
        self.assertIn("unroutable: no queue bound", rows[0].text)
        self.assertIn(str(dead), rows[0].text)
        # Requeue it with the action.
        rows[0].find_element(By.CSS_SELECTOR, "input.action-select").click()
        Select(b.find_element(By.NAME, "action")).select_by_value("requeue_dead")
        b.find_element(By.NAME, "index").click()
        messages = wait.until(EC.presence_of_element_located((By.CSS_SELECTOR, "ul.messagelist")))
        self.assertIn("Requeued 1 dead event(s): orders.created 1.", messages.text)
        self.assertEqual(OutboxEvent.objects.get(id=dead).status, Status.PENDING)
        self.assertEqual(OutboxEvent.objects.get(id=pending).status, Status.PENDING)
        # The row's page shows its fields read-only.
        b.get(f"{self.live_server_url}/admin/outbox/outboxevent/{dead}/change/")
        wait.until(EC.url_contains(f"/{dead}/change/"))
        self.assertIn("orders.created", b.find_element(By.ID, "content").text)
        self.assertEqual(b.find_elements(By.CSS_SELECTOR, "input[name=_save]"), [])
