"""PNG pictures: a screenshot of an HTML page (or an SVG wrapped in one) taken by headless
Chromium or Chrome. The browser is looked up as ``$FLEXPIPE_CHROMIUM`` or one of ``CANDIDATES`` on
the PATH; without one, a clear ``ConfigError`` says how to get one or to write SVG/HTML instead.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from flexpipe.errors import ConfigError

CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--mute-audio", "--disable-dev-shm-usage")
TIMEOUT_S = 90
MAX_SIDE = 16000


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome executable, or None."""
    env = os.environ.get("FLEXPIPE_CHROMIUM")
    if env:
        return shutil.which(env) or (env if Path(env).is_file() else None)
    return next((p for p in map(shutil.which, CANDIDATES) if p), None)


def screenshot(html: str, out: str | Path, width: int, height: int) -> Path:
    """Render ``html`` in headless Chromium and write a ``width`` x ``height`` PNG to ``out``."""
    browser = find_chromium()
    if browser is None:
        raise ConfigError("PNG output needs Chromium or Chrome, and none was found (looked for "
                          f"{', '.join(CANDIDATES)} and $FLEXPIPE_CHROMIUM); install one, e.g. "
                          "'apt-get install chromium', or write .svg or .html instead")
    width, height = max(1, min(int(width), MAX_SIDE)), max(1, min(int(height), MAX_SIDE))
    out = Path(out).resolve()
    with tempfile.TemporaryDirectory(prefix="flexpipe-png-") as tmp:
        page = Path(tmp) / "page.html"
        page.write_text(html, encoding="utf-8")
        shot = Path(tmp) / "shot.png"
        cmd = [browser, *FLAGS, f"--user-data-dir={Path(tmp) / 'profile'}",
               f"--screenshot={shot}", f"--window-size={width},{height}", page.as_uri()]
        _run(cmd)
        if not shot.is_file() or shot.stat().st_size == 0:
            raise ConfigError(f"{browser} did not write a screenshot")
        try:
            shutil.copyfile(shot, out)
        except OSError as exc:
            raise ConfigError(f"cannot write {str(out)!r}: {exc.strerror or exc}") from None
    return out


def _run(cmd: list[str]) -> None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                              check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{cmd[0]} took more than {TIMEOUT_S} s to render the picture") from None
    except OSError as exc:
        raise ConfigError(f"cannot start {cmd[0]}: {exc.strerror or exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ConfigError(f"{cmd[0]} failed (exit {done.returncode}): {' | '.join(tail)}")
