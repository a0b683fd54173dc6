"""``te-fl-attn explain --show-graph`` / ``--compare-log``, ``explain(show_graph=True)`` and the
acceptance run's graph diff (``scripts/gpu/graph_diff.py``), on deviceless cuDNN graphs."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from te_fl_attention import FusedAttnConfig, Selector, graphspec
from te_fl_attention.probes import default_probes
from te_fl_attention.selector import explain

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ["--preset", "llama3-8b", "--seqlen", "1024"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "te_fl_attention.cli", "explain", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)  # fmt: skip


@pytest.fixture(scope="module")
def llama_spec() -> dict:
    p = cli("--device", "h100", *LLAMA, "--show-graph", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)["detail"]["graph_spec"]


def test_show_graph_lists_both_graphs_as_cudnn_frontend_json(llama_spec):
    assert llama_spec["supported"] and set(llama_spec["graphs"]) == {"fwd", "bwd"}
    fwd = graphspec.roles(llama_spec["graphs"]["fwd"])
    # llama3-8b preset: sbhd, b=1, 32 heads (8 kv heads), s=1024, d=128: TE's sbhd strides
    assert fwd["in Q"]["dim"] == [1, 32, 1024, 128]
    assert fwd["in Q"]["stride"] == [32 * 128, 128, 1 * 32 * 128, 1]
    assert fwd["in K"]["dim"] == [1, 8, 1024, 128] and fwd["out Stats"]["data_type"] == "FLOAT"
    opts = graphspec.options(llama_spec["graphs"]["fwd"])
    assert opts["right_bound"] == 0 and opts["diagonal_alignment"] == "TOP_LEFT"
    bwd = graphspec.roles(llama_spec["graphs"]["bwd"])
    assert {"out dQ", "out dK", "out dV", "in dO", "in Stats"} <= set(bwd)


def test_show_graph_text_names_roles_and_options():
    p = cli("--device", "h100", *LLAMA, "--show-graph")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "cuDNN fwd graph (deviceless, cuDNN 9.28.1)" in p.stdout
    assert "cuDNN bwd graph" in p.stdout and "in Q" in p.stdout and "out dQ" in p.stdout
    assert "fwd options:" in p.stdout and "right_bound=0" in p.stdout


def test_compare_log_prints_every_difference(llama_spec, tmp_path):
    theirs = copy.deepcopy(llama_spec["graphs"])
    q = next(t for t in theirs["fwd"]["tensors"] if t["name"] == "Q")
    q["stride"] = [999, 128, 4096, 1]
    log = tmp_path / "te.log"
    log.write_text("[cudnn_frontend] INFO: graph\n" + json.dumps(theirs["fwd"]) + "\nnoise {\n"
                   + json.dumps(theirs["bwd"], indent=1))  # fmt: skip
    p = cli("--device", "h100", *LLAMA, "--compare-log", str(log))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "fwd: tensor in Q stride: ours [4096, 128, 4096, 1], theirs [999, 128, 4096, 1]" \
        in p.stdout  # fmt: skip
    assert "bwd: the same graph as the one in the log" in p.stdout
    empty = tmp_path / "empty.log"
    empty.write_text("nothing here")
    bad = cli("--device", "h100", *LLAMA, "--compare-log", str(empty))
    assert bad.returncode == 2 and "no cuDNN graph" in bad.stderr


def test_explain_api_attaches_the_spec_and_says_why_there_is_none():
    cfg = FusedAttnConfig(max_seqlen_q=256, num_heads=8, head_dim_qk=64, attn_mask_type="causal")
    d = explain(cfg, "b200", show_graph=True)
    assert d.detail["graph_spec"]["graphs"]["fwd"]["nodes"]
    refused = Selector(default_probes()).graph_spec(cfg.replace(dtype="fp32"), "b200")
    assert refused["graphs"] == {} and "fused.dtype" in refused["message"]
    assert Selector(default_probes(graph=False)).graph_spec(cfg, "b200") is None


def test_graph_diff_script_pairs_our_graphs_with_the_logged_ones(tmp_path):
    """The acceptance step, on CPU: a 'TE log' made of our own graphs for the first configs of
    the acceptance families, one of them changed; graph_diff finds exactly that change."""
    sys.path.insert(0, str(ROOT / "scripts" / "gpu"))
    from families import configs

    sel = Selector(default_probes())
    graphs = []
    for _, cfg in configs()[:3]:
        graphs += list((sel.graph_spec(cfg, "h100") or {}).get("graphs", {}).values())
    graphs[1] = copy.deepcopy(graphs[1])
    graphspec.sdpa_node(graphs[1])["is_deterministic_algorithm"] = True
    log = tmp_path / "te_graphs.log"
    log.write_text("\n".join(f"INFO: {json.dumps(g)}" for g in graphs))
    p = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu" / "graph_diff.py"), "--log",
                        str(log), "--device", "h100", "--limit", "3", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    n = len(graphs)
    assert f"graph_diff configs=3 graphs={n} identical={n - 1} differ=1 unmatched=0" in p.stdout
    assert "option is_deterministic_algorithm: ours False, theirs True" in p.stdout
    data = json.loads((tmp_path / "graph_diff.json").read_text())
    assert data["differ"] == 1 and len(data["rows"]) == n
