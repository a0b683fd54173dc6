"""The HTML report (fleet/report.py): self-contained, and it renders in headless Chromium (DOM
+ screenshot)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from te_fl_attention import FusedAttnConfig, Selector
from te_fl_attention.fleet import plan
from te_fl_attention.fleet.report import render_html
from te_fl_attention.presets import preset
from te_fl_attention.probes import default_probes

CONFIGS = {
    "llama3-8b": FusedAttnConfig(**preset("llama3-8b")),
    "gpt-oss-swa": FusedAttnConfig(**preset("gpt-oss-120b-swa")),
    "head-dim-320": FusedAttnConfig(head_dim_qk=320, num_heads=8),
    "fp32": FusedAttnConfig(dtype="fp32", num_heads=8),
}
DEVICES = ["a100", "h100", "b200", "t4"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        exe = shutil.which(name)
        if exe:
            return exe
    if shutil.which("apt-get") and os.geteuid() == 0:
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], env=env,
                       capture_output=True, timeout=900)  # fmt: skip
        exe = shutil.which("chromium")
        if exe:
            return exe
    pytest.fail("chromium is not installed and could not be installed here: run "
                "`apt-get install -y chromium` (CI installs it)")


def _browser(*args: str, home) -> subprocess.CompletedProcess:
    cmd = [_chromium(), "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
           f"--user-data-dir={home / 'profile'}", "--no-first-run", *args]
    env = {**os.environ, "HOME": str(home)}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("html")
    p = plan(CONFIGS, DEVICES, selector=Selector(default_probes(graph=False)))
    path = tmp / "fleet.html"
    path.write_text(render_html(p, uniform=True), encoding="utf-8")
    return p, path, tmp


def test_self_contained(page):
    _, path, _ = page
    text = path.read_text()
    assert "<style>" in text and "<script>" in text
    # no network: nothing is loaded from anywhere
    assert not re.search(r"""(src|href)\s*=|@import|url\(|https?://""", text)


def test_renders_in_headless_chromium(page):
    p, path, tmp = page
    dom = _browser("--dump-dom", f"file://{path}", home=tmp)
    assert dom.returncode == 0, dom.stderr[-2000:]
    html = dom.stdout
    cells = re.findall(r'<td class="cell (verified|predicted)"[^>]*data-backend="(\w+)"', html)
    assert len(cells) == len(CONFIGS) * len(DEVICES)
    assert {b for _, b in cells} == {"fused", "flash", "triton", "unfused"}
    assert html.count('class="cell uniform"') == len(CONFIGS)
    assert "on t4 4 configs fall back to unfused" in html
    assert "FusedAttention needs compute capability &gt;= sm80 (found sm75)" in html
    shot = tmp / "fleet.png"
    run = _browser(f"--screenshot={shot}", "--window-size=1500,1100", f"file://{path}",
                   home=tmp)  # fmt: skip
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 50_000  # a rendered page, not a blank one (a blank PNG is ~5 KB)
