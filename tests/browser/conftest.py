"""JupyterLab in headless Chromium: the set-up the browser tests share.

- Chromium is Debian's ``chromium`` package (``/usr/bin/chromium``), installed here with apt when
  it is missing and this is root; playwright (PyPI, the dev extra) drives that binary through
  ``executable_path`` -- never ``playwright install``.  Without root or apt the tests skip, saying so.
- JupyterLab (the dev extra) runs on 127.0.0.1 with a token and ``--allow-root``, on copies of
  the notebooks (the repository's notebooks are never saved into), with its own settings and
  workspace folders, every cell rendered (no windowing) and the app exposed to the page so a
  test can run JupyterLab's own commands (``notebook:run-all-cells``).
- One JupyterLab page per worker (``lab_page``): the tests open their notebooks in it one at a time, each closed and
  its kernel shut down before the next (loading the page costs ~5 s of a 2-core machine, opening a notebook in it
  ~1 s); a notebook "reopened" by a test opens in a fresh page of its own.
- Artefacts (screenshots, the executed copies, the runs they launched) go to
  ``$WORKBENCH_ARTIFACTS`` or ``runs/browser-<timestamp>/`` (git-ignored), in a folder per xdist worker.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import shutil
import subprocess
import tempfile
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from tests.support import ROOT, apt_install, free_port
from workbench.launch.ownership import die_with_parent

# the helpers the browser test files share (tests/support/browser_*.py): pytest rewrites their assertions as it does
# the test files' own, so that a failing check there reports its values as it did when it lived in a test file
pytest.register_assert_rewrite("tests.support.browser_notebooks", "tests.support.browser_widgets")

CHROMIUM = "/usr/bin/chromium"
VIEWPORT = {"width": 1500, "height": 1100}

# the notebook open in the page (its path), once its kernel is idle or JupyterLab asks which kernel to start
OPENED_JS = """(path) => {
  const w = window.jupyterapp.shell.currentWidget;
  const asks = Array.from(document.querySelectorAll('.jp-Dialog button')).some(b => b.innerText.trim() === 'Select');
  return asks || (w?.context?.path === path && w.sessionContext?.session?.kernel?.status === 'idle');
}"""

# save the notebook open in the page, or fail after a minute
SAVE_JS = """() => Promise.race([window.jupyterapp.commands.execute('docmanager:save'),
  new Promise((_, fail) => setTimeout(() => fail(new Error('the notebook was not saved within 60 s')), 60000))])"""

# the documents open in the page's main area (its launcher aside), and their paths
DOCUMENTS = "Array.from(window.jupyterapp.shell.widgets('main')).filter(w => w.context)"
OPEN_DOCUMENTS_JS = f"() => {DOCUMENTS}.map(w => w.context.path)"


def _ensure_chromium() -> str:
    if Path(CHROMIUM).exists():
        return CHROMIUM
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        # in CI the notebooks 02-09 run with their defaults only here (tests/support/notebook_checks.BROWSER_RUNS)
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"{CHROMIUM} is missing and cannot be installed here (needs root and apt-get): "
                    "apt-get install -y chromium, then run bash launch/test.sh tests/browser")
    try:
        apt_install(["chromium"], lambda: Path(CHROMIUM).exists())
    except RuntimeError as e:
        pytest.fail(str(e))
    assert Path(CHROMIUM).exists(), "apt-get installed chromium but /usr/bin/chromium is missing"
    return CHROMIUM


@pytest.fixture(scope="session")
def artefacts() -> Path:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # parallel workers: a folder (and a JupyterLab) each
    d = Path(os.environ.get("WORKBENCH_ARTIFACTS") or ROOT / "runs" / f"browser-{datetime.now():%Y%m%d-%H%M%S}")
    d = (d / worker if worker else d).absolute()
    (d / "screenshots").mkdir(parents=True, exist_ok=True)
    print(f"\nbrowser test artefacts: {d}")
    return d


def _settings(folder: Path) -> None:
    """JupyterLab user settings: every cell in the DOM, no news or update checks, no autosave (the tests save; an
    autosave two minutes after opening, as a long Run All ends, held the test's own save on "File Changed")."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false", "checkForUpdates": False},
    }
    for rel, data in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data))


def _app_settings(folder: Path) -> Path:
    """The app settings JupyterLab reads its overrides from: the ones the project ships (``launch/jupyterlab``, put into
    the venv by launch/setup.sh: widget state saved into the notebook), or none with ``WORKBENCH_STOCK_JUPYTERLAB=1``
    (a researcher's own JupyterLab)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if os.environ.get("WORKBENCH_STOCK_JUPYTERLAB") != "1":
        shutil.copytree(ROOT / "launch" / "jupyterlab" / "overrides.d", folder / "overrides.d")
    return folder


@pytest.fixture(scope="session")
def lab(artefacts):
    """A JupyterLab server on the artefacts folder: {url, token, root}."""
    chromium = _ensure_chromium()
    root = artefacts / "lab"
    root.mkdir(exist_ok=True)
    _settings(artefacts / "lab-settings")
    app_settings = _app_settings(artefacts / "lab-app-settings")
    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "WORKBENCH_HEADLESS")}  # a person's live kernel
    # kernels talk over unix sockets (ipc), not TCP: a kernel given a TCP port that a rank's gloo or rendezvous took in
    # the meantime died binding it ("Address already in use") and hung in its exit while the server waited for it
    # (CI at 8f7ff95); the socket paths live in the runtime folder, which stays short for the 107-byte limit
    runtime = Path(tempfile.mkdtemp(prefix="wb-lab-", dir="/tmp"))
    env.update(JUPYTERLAB_SETTINGS_DIR=str(artefacts / "lab-settings"), JUPYTERLAB_WORKSPACES_DIR=str(artefacts / "lab-workspaces"),
               JUPYTER_RUNTIME_DIR=str(runtime), PYTHONPATH=str(ROOT))
    log = open(artefacts / "jupyterlab.log", "wb")
    server = None
    try:
        # a port taken between free_port() and the server's bind (another test run on the machine): the server exits
        # (no retries on other ports, which this fixture would not be polling) and starts again on a new port
        for _ in range(3):
            port = free_port()
            cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
                   "--ServerApp.port_retries=0", "--allow-root", "--KernelManager.transport=ipc",
                   f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
                   "--ServerApp.disable_check_xsrf=False", "--LabServerApp.open_browser=False",
                   f"--LabApp.app_settings_dir={app_settings}"]
            # a pytest that is killed (CI's time limit) takes the server, so its kernels and their runs, with it
            server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                      preexec_fn=die_with_parent(signal.SIGTERM))
            url = f"http://127.0.0.1:{port}"
            end = time.time() + 90
            while server.poll() is None:
                try:
                    with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                        if r.status == 200:
                            break
                except OSError:
                    pass
                if time.time() > end:
                    raise AssertionError(f"JupyterLab did not answer in 90 s; see {artefacts / 'jupyterlab.log'}")
                time.sleep(0.5)
            if server.poll() is None:
                break
        else:
            raise AssertionError(f"JupyterLab did not start (3 tries); see {artefacts / 'jupyterlab.log'}")
        yield {"url": url, "token": token, "root": root, "chromium": chromium}
    finally:
        if server is not None:
            server.terminate()
            try:
                server.wait(timeout=20)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
        log.close()
        shutil.rmtree(runtime, ignore_errors=True)


@pytest.fixture(scope="session")
def browser(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=lab["chromium"], headless=True,
                               args=["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"])
        try:
            yield b
        finally:
            b.close()


class LabPage:
    """The worker's one JupyterLab page; ``console``: every browser error it logged (``console.error``, uncaught)."""

    def __init__(self, browser, lab):
        self.browser, self.lab = browser, lab
        self.console: list[str] = []
        self.mark = 0  # where the next notebook's console entries start: what the last one closed left
        self._page = None

    @property
    def page(self):
        """The page, loaded again if a test closed it or it crashed."""
        if self._page is None or self._page.is_closed():
            page = self.browser.new_page(viewport=VIEWPORT)
            page.set_default_timeout(60_000)
            page.on("crash", lambda _: setattr(self, "_page", None))  # the test that saw it fails; the next loads one
            page.on("console", lambda m: self.console.append(f"{m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: self.console.append(f"pageerror: {e}"))
            page.goto(f"{self.lab['url']}/lab/workspaces/browser-tests?reset&token={self.lab['token']}")
            page.wait_for_function("() => window.jupyterapp?.shell", timeout=120_000)
            page.evaluate("async () => { await window.jupyterapp.restored; }")
            self._page = page
        return self._page

    def open(self, path: str) -> int:
        """Open ``path`` (in the server's root) in a tab of its own, the page 1500 x 1100 px, and wait for its kernel to be
        idle (JupyterLab asks for a kernel when it cannot tell which to start: the default, as a person would take it);
        the index in ``console`` from which the entries are this notebook's."""
        page = self.page
        still = page.evaluate(OPEN_DOCUMENTS_JS)
        assert not still, f"{path}: a notebook is still open in the page: {still}"
        page.set_viewport_size(VIEWPORT)
        page.evaluate("(path) => { window.jupyterapp.commands.execute('docmanager:open', {path}); }", path)
        try:
            page.wait_for_function(OPENED_JS, arg=path, timeout=120_000)
            chooser = page.locator(".jp-Dialog button", has_text="Select")
            if chooser.count():
                chooser.click()
                page.wait_for_function(OPENED_JS, arg=path, timeout=120_000)
            page.wait_for_selector(".jp-Notebook")
        except BaseException:  # this test fails; the page is left clean for the next (no notebook open, console marked)
            self.close(save=False)
            raise
        return self.mark

    def close(self, save: bool) -> None:
        """Save the open notebook if ``save`` (awaited: the tests read the saved file next), close its tab and shut its
        kernel down (each notebook's kernel holds memory)."""
        page = self.page
        sessions = page.evaluate(f"() => {DOCUMENTS}.map(w => w.sessionContext?.session?.id).filter(s => s)")
        try:
            if save:  # its promise: the write (bounded: a dialog it opened would wait for a person)
                page.evaluate(SAVE_JS)
                page.wait_for_function("() => !window.jupyterapp.shell.currentWidget?.context?.model?.dirty", timeout=60_000)
        finally:
            try:
                page.evaluate(f"() => {{ {DOCUMENTS}.forEach(w => w.dispose()); }}")
            finally:
                for session in sessions:
                    req = urllib.request.Request(f"{self.lab['url']}/api/sessions/{session}?token={self.lab['token']}",
                                                 method="DELETE")
                    try:
                        urllib.request.urlopen(req, timeout=30).close()
                    except OSError as e:
                        print(f"[browser] could not shut down a kernel: {e}")
                # what the disposed views still log (a widget view whose model went with the kernel) is this
                # notebook's, not the next one's: a moment for it to arrive before the mark
                page.wait_for_timeout(1000)
                self.mark = len(self.console)


@pytest.fixture(scope="session")
def lab_page(browser, lab):
    """The worker's one JupyterLab page (:class:`LabPage`): the page as it loaded logged no error."""
    app = LabPage(browser, lab)
    assert app.page and not app.console, f"JupyterLab's page logged errors as it loaded: {app.console}"
    yield app
    if app._page is not None and not app._page.is_closed():
        app._page.close()
