"""``graphspec``: reading cudnn-frontend graph JSON, finding graphs in a log, diffing by role."""

from __future__ import annotations

import copy
import json

from te_fl_attention import graphspec


def _tensor(uid, name, dim, stride, dtype="BFLOAT16", offset=None, by_value=False):
    t = {"uid": uid, "name": name, "dim": dim, "stride": stride, "data_type": dtype,
         "is_pass_by_value": by_value, "is_virtual": False, "reordering_type": "NONE",
         "pass_by_value": None}  # fmt: skip
    if offset:
        t["ragged_offset_name"], t["ragged_offset_uid"] = offset
    return t


def spec(s=1024, b=32, left=None):
    tensors = [
        _tensor(1, "Q", [b, 8, s, 64], [s * 512, 64, 512, 1], offset=("offset_q", 7)),
        _tensor(2, "K", [b, 8, s, 64], [s * 512, 64, 512, 1], offset=("offset_k", 8)),
        _tensor(3, "V", [b, 8, s, 64], [s * 512, 64, 512, 1], offset=("offset_v", 9)),
        _tensor(4, "attn_scale", [1, 1, 1, 1], [1, 1, 1, 1], "FLOAT", by_value=True),
        _tensor(5, "O", [b, 8, s, 64], [s * 512, 64, 512, 1]),
        _tensor(6, "Stats", [b, 8, s, 1], [8 * s, 1, 8, 1], "FLOAT"),
        _tensor(7, "offset_q", [b + 1, 1, 1, 1], [1, 1, 1, 1], "INT64"),
        _tensor(8, "offset_k", [b + 1, 1, 1, 1], [1, 1, 1, 1], "INT64"),
        _tensor(9, "offset_v", [b + 1, 1, 1, 1], [1, 1, 1, 1], "INT64"),
    ]
    node = {"tag": "SDPA_FWD", "name": "flash_attention", "diagonal_alignment": "TOP_LEFT",
            "left_bound": left, "right_bound": 0, "padding_mask": True,
            "inputs": {"Q": 1, "K": 2, "V": 3, "Attn_scale": 4}, "outputs": {"O": 5, "Stats": 6}}
    return {"context": {"io_data_type": "BFLOAT16", "compute_data_type": "FLOAT", "sm_count": -1},
            "nodes": [node], "tensors": tensors}


def test_roles_fold_ragged_offsets_in():
    r = graphspec.roles(spec())
    assert set(r) == {"in Q", "in K", "in V", "in Attn_scale", "out O", "out Stats"}
    assert r["in Q"]["ragged_offset"] == {"dim": [33, 1, 1, 1], "data_type": "INT64"}
    assert r["out O"]["ragged_offset"] is None and r["in Attn_scale"]["is_pass_by_value"]
    opts = graphspec.options(spec())
    assert opts["right_bound"] == 0 and opts["context.io_data_type"] == "BFLOAT16"
    assert "inputs" not in opts and "name" not in opts


def test_diff_names_every_difference_and_ignores_names_and_uids():
    ours, theirs = spec(), spec()
    assert graphspec.diff(ours, theirs) == []
    renamed = copy.deepcopy(theirs)
    for t in renamed["tensors"]:
        t["name"] = t["name"].lower()
        t["uid"] += 100
        if "ragged_offset_uid" in t:
            t["ragged_offset_uid"] += 100
            t["ragged_offset_name"] = t["ragged_offset_name"].lower()
    n = renamed["nodes"][0]
    n["inputs"] = {k: v + 100 for k, v in n["inputs"].items()}
    n["outputs"] = {k: v + 100 for k, v in n["outputs"].items()}
    assert graphspec.diff(ours, renamed) == []
    theirs["tensors"][5]["stride"] = [1024 * 8, 1024, 1, 1]  # Stats: BHS1 instead of TH1
    theirs["nodes"][0]["left_bound"] = 129
    theirs["tensors"][6]["data_type"] = "INT32"  # offset_q
    out = graphspec.diff(ours, theirs)
    assert "option left_bound: ours None, theirs 129" in out
    assert any(x.startswith("tensor out Stats stride: ours [8192, 1, 8, 1]") for x in out)
    assert any(x.startswith("tensor in Q ragged_offset") and "INT32" in x for x in out)
    assert len(out) == 3


def test_graphs_in_log_finds_every_graph_among_other_text():
    text = ("[cudnn_frontend] INFO: validating {not json} \n"
            + json.dumps(spec()) + "\n[cudnn_frontend] INFO: {\"a\": 1}\n"
            + json.dumps(spec(s=2048), indent=2) + "\ntrailing {")  # fmt: skip
    found = graphspec.graphs_in_log(text)
    assert len(found) == 2 and found[1]["tensors"][0]["dim"][2] == 2048


def test_match_pairs_by_signature_and_picks_the_closest():
    ours = spec()
    near, far, other = spec(left=5), spec(left=5), spec(s=2048)
    far["nodes"][0]["padding_mask"] = False
    best, differences = graphspec.match(ours, [other, far, near])
    assert best is near and differences == ["option left_bound: ours None, theirs 5"]
    none, why = graphspec.match(ours, [other])
    assert none is None and why[0].startswith("no graph with the signature")
