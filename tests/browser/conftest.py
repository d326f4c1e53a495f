"""JupyterLab in headless Chromium: the set-up the browser tests share.

- Chromium is Debian's ``chromium`` package (``/usr/bin/chromium``), installed here with apt when
  it is missing and this is root; playwright (PyPI, the dev extra) drives that binary through
  ``executable_path`` -- never ``playwright install``.  Without root or apt the tests skip, saying so.
- JupyterLab (the dev extra) runs on 127.0.0.1 with a token and ``--allow-root``, on copies of
  the notebooks (the repository's notebooks are never saved into), with its own settings and
  workspace folders, every cell rendered (no windowing) and the app exposed to the page so a
  test can run JupyterLab's own commands (``notebook:run-all-cells``).
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
import sys
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import pytest

from tests.support import ROOT, apt_install, free_port
from workbench.launch.ownership import die_with_parent

CHROMIUM = "/usr/bin/chromium"


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
    """JupyterLab user settings: every cell in the DOM, no news or update checks."""
    files = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
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
    port, token = free_port(), secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k not in ("MPLBACKEND", "WORKBENCH_HEADLESS")}  # a person's live kernel
    env.update(JUPYTERLAB_SETTINGS_DIR=str(artefacts / "lab-settings"), JUPYTERLAB_WORKSPACES_DIR=str(artefacts / "lab-workspaces"),
               JUPYTER_RUNTIME_DIR=str(artefacts / "lab-runtime"), PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}", "--allow-root",
           f"--IdentityProvider.token={token}", f"--ServerApp.root_dir={root}", "--LabApp.expose_app_in_browser=True",
           "--ServerApp.disable_check_xsrf=False", "--LabServerApp.open_browser=False",
           f"--LabApp.app_settings_dir={app_settings}"]
    log = open(artefacts / "jupyterlab.log", "wb")
    # a pytest that is killed (CI's time limit) takes the server, so its kernels and their runs, with it
    server = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              preexec_fn=die_with_parent(signal.SIGTERM))
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + 90
        while True:
            try:
                with urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None or time.time() > end:
                raise AssertionError(f"JupyterLab did not start; see {artefacts / 'jupyterlab.log'}")
            time.sleep(0.5)
        yield {"url": url, "token": token, "root": root, "chromium": chromium}
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()


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
