"""``GraphBuilder``: TE 2.20.2's forward and backward cuDNN graphs of one derived config
(``create_graph_f16_fwd/bwd``, ``create_graph_fp8_fwd/bwd``)."""

from __future__ import annotations

from typing import Any

from .mapping import TEGraphConfig, te_matrix_strides


def _dtype(cudnn: Any, name: str) -> Any:
    dt = cudnn.data_type
    return {
        "fp16": dt.HALF,
        "bf16": dt.BFLOAT16,
        "fp32": dt.FLOAT,
        "fp8_e4m3": dt.FP8_E4M3,
        "fp8_e5m2": dt.FP8_E5M2,
        "INT32": dt.INT32,
        "INT64": dt.INT64,
    }[name]


def io_dtype(cudnn: Any, d: TEGraphConfig) -> Any:
    """The graph's io type: TE sets ``set_io_data_type(qkv dtype)`` in every builder."""
    return _dtype(cudnn, d.qkv_dtype)


class GraphBuilder:
    """Builds TE 2.20.2's forward or backward graph of one derived config on one backend graph.

    Tensors TE creates without a data type are created without one here (cudnn-frontend fills
    in the graph's io type), so the graph's JSON matches TE's; the creation order follows TE's
    builders (it decides the UIDs cudnn-frontend hands out)."""

    def __init__(self, cudnn: Any, g: Any, d: TEGraphConfig) -> None:
        self.cudnn, self.g, self.d = cudnn, g, d
        self.dt = cudnn.data_type

    # -------------------------------------------------------------- helpers
    def t(self, name: str, dim: list[int], stride: list[int], dtype: Any = None, **kw: Any) -> Any:
        """``mha_graph->tensor(...)``; ``dtype=None``: TE sets no data type."""
        return self.g.tensor(
            name=name,
            dim=dim,
            stride=stride,
            data_type=self.dt.NOT_SET if dtype is None else dtype,
            **kw,
        )

    def scalar(self, name: str, dtype: Any = None, by_value: bool = False) -> Any:
        return self.t(
            name,
            [1, 1, 1, 1],
            [1, 1, 1, 1],
            self.dt.FLOAT if dtype is None else dtype,
            is_pass_by_value=by_value,
        )

    def one(self) -> Any:
        """TE's ``mha_graph->tensor(1.0f)``: a pass-by-value FLOAT 1.0 of dim/stride ``{1}``."""
        return self.g.tensor_scalar(1.0, self.cudnn.scalar_type.RUNTIME_PARAM)

    def offset(self, name: str, b: int, dtype: str) -> Any:
        """A ragged offset tensor ``[b+1, 1, 1, 1]`` stride 1 (every TE builder)."""
        return self.t(name, [b + 1, 1, 1, 1], [1, 1, 1, 1], _dtype(self.cudnn, dtype))

    def attach(self, tensor: Any, off: Any, role: str, with_mult: bool) -> None:
        """``set_ragged_offset`` (+ ``set_ragged_offset_multiplier`` when TE passes cu_seqlens
        directly, forward only)."""
        tensor.set_ragged_offset(off)
        if with_mult:
            tensor.set_ragged_offset_multiplier(self.d.offset_mults[role])

    def strides(self, matrix: str, b: int, h: int, d: int) -> list[int]:
        x = self.d
        return te_matrix_strides(
            x.layout, matrix, b, h, x.graph_max_seqlen_q, x.graph_max_seqlen_kv, d
        )

    def stats_stride(self, b: int) -> list[int]:
        """TH1 ``{h*s_q, 1, h, 1}`` on the ragged path (uses_ragged_stats), else BHS1
        ``{h*s_q, s_q, 1, 1}`` (create_graph_f16_fwd/bwd, create_graph_fp8_fwd/bwd)."""
        h, sq = self.d.h, self.d.graph_max_seqlen_q
        return [h * sq, 1, h, 1] if self.d.uses_ragged_stats else [h * sq, sq, 1, 1]

    def masking(self, kw: dict[str, Any], fp8: bool) -> None:
        """Diagonal alignment and band bounds. F16 (create_graph_f16_fwd/bwd, no version gate in
        2.20.2): BOTTOM_RIGHT iff bottom_right_diagonal; left = window_left + 1 unless -1;
        right = window_right unless -1; right 0 for both causal kinds. FP8
        (create_graph_fp8_fwd/bwd): ``set_causal_mask(is_causal)``, the bounds only with cuDNN
        >= 9.21, right 0 for bottom-right causal. cudnn-frontend's ``set_causal_mask(true)`` is
        TOP_LEFT + right bound 0 (graph_properties.h); its Python binding refuses
        ``use_causal_mask`` together with a right bound, so that effect is passed instead."""
        x = self.d
        left, right = x.window
        kw["diagonal_alignment"] = getattr(
            self.cudnn.diagonal_alignment, "BOTTOM_RIGHT" if x.bottom_right_diagonal else "TOP_LEFT"
        )
        lk, rk = ("left_bound", "right_bound") if fp8 else (
            "diagonal_band_left_bound", "diagonal_band_right_bound")  # fmt: skip
        if not fp8 or x.cudnn_version >= 92100:
            if left != -1:
                kw[lk] = left + 1
            if right != -1:
                kw[rk] = right
        if x.causal_bottom_right or x.causal:
            kw[rk] = 0

    def padding(self, kw: dict[str, Any], b: int, fwd: bool) -> None:
        """Padding: forward with cu_seqlens directly -> ``cu_seq_len_q/kv`` ``[b+1]`` INT32 and
        ``implementation(UNIFIED)``; otherwise (and always in the backward) ``seq_q/seq_kv``
        ``[b]`` INT32 (create_graph_f16_fwd/bwd, create_graph_fp8_fwd/bwd)."""
        if not self.d.padding:
            return
        kw["use_padding_mask"] = True
        i32 = self.dt.INT32
        if fwd and self.d.uses_cu_seqlens_directly:
            kw["cu_seq_len_q"] = self.t("cu_seq_len_q", [b + 1, 1, 1, 1], [1, 1, 1, 1], i32)
            kw["cu_seq_len_kv"] = self.t("cu_seq_len_kv", [b + 1, 1, 1, 1], [1, 1, 1, 1], i32)
            kw["implementation"] = self.cudnn.attention_implementation.UNIFIED
        else:
            kw["seq_len_q"] = self.t("seq_q", [b, 1, 1, 1], [1, 1, 1, 1], i32)
            kw["seq_len_kv"] = self.t("seq_kv", [b, 1, 1, 1], [1, 1, 1, 1], i32)

    def dropout(self, kw: dict[str, Any]) -> None:
        """``Seed`` / ``Offset``: INT64 ``[1,1,1,1]`` device tensors (every builder)."""
        if self.d.dropout:
            seed = self.scalar("Seed", self.dt.INT64)
            offset = self.scalar("Offset", self.dt.INT64)
            kw["dropout"] = (self.d.dropout, seed, offset)

    def sink(self, kw: dict[str, Any], bwd: bool) -> None:
        """Off-by-one / learnable softmax: ``softmax_offset`` ``[1,h,1,1]`` FLOAT as the sink
        token; the backward also ``d_softmax_offset`` (``set_dsink_token``)."""
        if not self.d.softmax_offset:
            return
        h = self.d.h
        kw["sink_token"] = self.t("softmax_offset", [1, h, 1, 1], [h, 1, 1, 1], self.dt.FLOAT)
        if bwd:
            kw["dSink_token"] = self.t(
                "d_softmax_offset", [1, h, 1, 1], [h, 1, 1, 1], self.dt.FLOAT
            )

    def bias(self, kw: dict[str, Any], bwd: bool) -> None:
        """Post-scale bias with its real dims, strides ``[h*sq*skv, sq*skv, skv, 1]``; in the
        backward dBias with the same dims unless the bias is ``[1, 1, 1, s_kv]`` whether or not
        it needs a gradient (create_graph_f16_bwd; TE's torch extension always allocates dBias,
        csrc/extensions/attention.cpp)."""
        dims = self.d.bias_dims
        if dims is None:
            return
        bb, bh, bsq, bskv = dims
        stride = [bh * bsq * bskv, bsq * bskv, bskv, 1]
        kw["bias"] = self.t("bias", list(dims), stride)
        if bwd and not (bb == 1 and bh == 1 and bsq == 1):
            kw["dBias"] = self.t("dBias", list(dims), stride)

    # -------------------------------------------------------------- F16/BF16
    def f16_forward(self) -> None:
        """``create_graph_f16_fwd`` (fused_attn_f16_arbitrary_seqlen.cu)."""
        x, dt = self.d, self.dt
        b, h, hg, dqk, dv = x.graph_batch_size_fwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        odt, mult = x.ragged_offset_type_fwd, x.uses_cu_seqlens_directly
        q = self.t("Q", [b, h, sq, dqk], self.strides("Q", b, h, dqk))
        if x.ragged_q:
            self.attach(q, self.offset("offset_q", b, odt), "q", mult)
        if x.paged:
            npg, ps = x.num_pages, x.page_size
            k_stride = te_matrix_strides(x.layout, "K", npg, hg, ps, ps, dqk)
            v_stride = te_matrix_strides(x.layout, "V", npg, hg, ps, ps, dv)
            k = self.t("K", [npg, hg, ps, dqk], k_stride)
            v = self.t("V", [npg, hg, ps, dv], v_stride)
        else:
            k = self.t("K", [b, hg, skv, dqk], self.strides("K", b, hg, dqk))
            v = self.t("V", [b, hg, skv, dv], self.strides("V", b, hg, dv))
            if x.ragged_kv:
                off_k = self.offset("offset_k", b, odt)
                off_v = self.offset("offset_v", b, odt)
                self.attach(k, off_k, "k", mult)
                self.attach(v, off_v, "v", mult)
        kw: dict[str, Any] = {"attn_scale": self.scalar("attn_scale", by_value=True)}
        self.masking(kw, fp8=False)
        kw["use_alibi_mask"] = x.alibi
        self.bias(kw, bwd=False)
        self.padding(kw, b, fwd=True)
        if x.paged:
            n = x.max_pages_per_seq  # TE: page_table_k strides {mpps_k, mpps_v, 1, 1} (sic)
            kw["paged_attention_k_table"] = self.t("page_table_k", [b, 1, n, 1], [n, n, 1, 1],
                                                   dt.INT32)  # fmt: skip
            kw["paged_attention_v_table"] = self.t("page_table_v", [b, 1, n, 1], [n, n, 1, 1],
                                                   dt.INT32)  # fmt: skip
            kw["paged_attention_max_seq_len_kv"] = skv
        self.dropout(kw)
        self.sink(kw, bwd=False)
        off_stats = self.offset("offset_stats", b, odt) if x.uses_ragged_stats else None
        if x.return_max_logit:
            mx = self.t("Max", [b, h, sq, 1], self.stats_stride(b), dt.FLOAT)
            if off_stats is not None:
                self.attach(mx, off_stats, "stats", mult)
            kw["score_max"] = mx
        o, stats = self.g.sdpa(q, k, v, generate_stats=True, name="flash_attention", **kw)
        o.set_output(True).set_dim([b, h, sq, dv]).set_stride(self.strides("O", b, h, dv))
        if x.ragged_q:
            self.attach(o, self.offset("offset_o", b, odt), "o", mult)
        stats.set_output(True).set_data_type(dt.FLOAT).set_dim([b, h, sq, 1])
        stats.set_stride(self.stats_stride(b))
        if off_stats is not None:
            self.attach(stats, off_stats, "stats", mult)

    def _bwd_inputs(self, stats_name: str, dtypes: tuple[Any, ...]) -> tuple[Any, ...]:
        """The backward graphs' inputs, in TE's creation order (``create_graph_f16_bwd`` and
        ``create_graph_fp8_bwd`` agree): Q, K, V, O, dO (``dtypes``: their data types, ``None``
        where TE sets none), their ragged offsets (always ``ragged_offset_type_bwd``, INT64; dO
        shares O's), and the stats with ``offset_stats`` when they are ragged. Returns
        ``(q, k, v, o, d_o, stats, offsets)``."""
        x, dt = self.d, self.dt
        b, h, hg, dqk, dv = x.graph_batch_size_bwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        odt = x.ragged_offset_type_bwd
        qs, ks = self.strides("Q", b, h, dqk), self.strides("K", b, hg, dqk)
        vs, os_ = self.strides("V", b, hg, dv), self.strides("O", b, h, dv)
        q = self.t("Q", [b, h, sq, dqk], qs, dtypes[0])
        k = self.t("K", [b, hg, skv, dqk], ks, dtypes[1])
        v = self.t("V", [b, hg, skv, dv], vs, dtypes[2])
        o = self.t("O", [b, h, sq, dv], os_, dtypes[3])
        d_o = self.t("dO", [b, h, sq, dv], os_, dtypes[4])
        off: dict[str, Any] = {}
        if x.ragged_q:
            off["q"], off["o"] = self.offset("offset_q", b, odt), self.offset("offset_o", b, odt)
            for tensor, role in ((q, "q"), (o, "o"), (d_o, "o")):
                tensor.set_ragged_offset(off[role])
        if x.ragged_kv:
            off["k"], off["v"] = self.offset("offset_k", b, odt), self.offset("offset_v", b, odt)
            k.set_ragged_offset(off["k"])
            v.set_ragged_offset(off["v"])
        stats = self.t(stats_name, [b, h, sq, 1], self.stats_stride(b), dt.FLOAT)
        if x.uses_ragged_stats:
            stats.set_ragged_offset(self.offset("offset_stats", b, odt))
        return q, k, v, o, d_o, stats, off

    def f16_backward(self) -> None:
        """``create_graph_f16_bwd`` (fused_attn_f16_arbitrary_seqlen.cu)."""
        x = self.d
        b, h, hg, dqk, dv = x.graph_batch_size_bwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        q, k, v, o, d_o, stats, off = self._bwd_inputs("stats", (None,) * 5)
        qs, ks, vs = (t.get_stride() for t in (q, k, v))
        kw: dict[str, Any] = {"attn_scale": self.scalar("attn_scale", by_value=True)}
        # max_total_seq_len: q iff ragged stats, kv iff ragged kv on the ragged graph (2.20.2
        # binary 0x1965f11-0x1965f4f); never in the forward.
        if x.uses_ragged_stats:
            kw["max_total_seq_len_q"] = sq
        if x.ragged_kv and x.uses_ragged_graph:
            kw["max_total_seq_len_kv"] = skv
        self.masking(kw, fp8=False)
        kw["use_deterministic_algorithm"] = x.deterministic
        kw["use_alibi_mask"] = x.alibi
        self.bias(kw, bwd=True)
        self.padding(kw, b, fwd=False)
        self.dropout(kw)
        self.sink(kw, bwd=True)
        dq, dk, dv_ = self.g.sdpa_backward(
            q, k, v, o, d_o, stats, name="flash_attention_backward", **kw
        )
        dq.set_output(True).set_dim([b, h, sq, dqk]).set_stride(qs)
        dk.set_output(True).set_dim([b, hg, skv, dqk]).set_stride(ks)
        dv_.set_output(True).set_dim([b, hg, skv, dv]).set_stride(vs)
        if x.ragged_q:
            dq.set_ragged_offset(off["q"])
        if x.ragged_kv:
            dk.set_ragged_offset(off["k"])
            dv_.set_ragged_offset(off["v"])

    # -------------------------------------------------------------- FP8 (per-tensor scaling)
    def fp8_forward(self) -> None:
        """``create_graph_fp8_fwd`` (fused_attn_fp8.cu), per-tensor (delayed / current)
        scaling: scalar FLOAT ``Descale_q``/``Descale_q`` (TE names K's descale like Q's)/
        ``Descale_v``/``Descale_s``/``Scale_s``, ``Scale_o`` a real input for delayed and a
        constant 1.0 for current scaling; outputs O (o dtype), Stats, ``amax_s``, ``amax_o``."""
        x, dt, cd = self.d, self.dt, self.cudnn
        b, h, hg, dqk, dv = x.graph_batch_size_fwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        odt, mult = x.ragged_offset_type_fwd, x.uses_cu_seqlens_directly
        io = _dtype(cd, x.qkv_dtype)
        q = self.t("Q", [b, h, sq, dqk], self.strides("Q", b, h, dqk), io)
        if x.ragged_q:
            self.attach(q, self.offset("offset_q", b, odt), "q", mult)
        k = self.t("K", [b, hg, skv, dqk], self.strides("K", b, hg, dqk), io)
        v = self.t("V", [b, hg, skv, dv], self.strides("V", b, hg, dv), io)
        if x.ragged_kv:
            off_k, off_v = self.offset("offset_k", b, odt), self.offset("offset_v", b, odt)
            self.attach(k, off_k, "k", mult)
            self.attach(v, off_v, "v", mult)
        attn_scale = self.scalar("attn_scale", by_value=True)
        descale_q = self.scalar("Descale_q")
        descale_k = self.g.tensor_like(descale_q, "Descale_q")
        descale_v = self.g.tensor_like(descale_q, "Descale_v")
        descale_s = self.g.tensor_like(descale_q, "Descale_s")
        scale_s = self.g.tensor_like(descale_q, "Scale_s")
        scale_o = self.g.tensor_like(descale_q, "Scale_o") if x.fp8_delayed else self.one()
        kw: dict[str, Any] = {"attn_scale": attn_scale}
        self.masking(kw, fp8=True)
        self.padding(kw, b, fwd=True)
        self.dropout(kw)
        self.sink(kw, bwd=False)
        o, stats, amax_s, amax_o = self.g.sdpa_fp8(
            q, k, v, descale_q, descale_k, descale_v, descale_s, scale_s, scale_o,
            generate_stats=True, name="sdpa_fp8", **kw,
        )  # fmt: skip
        amax_s.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
        amax_s.set_data_type(dt.FLOAT)
        o.set_output(True).set_dim([b, h, sq, dv]).set_stride(self.strides("O", b, h, dv))
        o.set_data_type(_dtype(cd, x.o_dtype))
        if x.ragged_q:
            self.attach(o, self.offset("offset_o", b, odt), "o", mult)
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
        amax_o.set_data_type(dt.FLOAT)
        stats.set_output(True).set_data_type(dt.FLOAT).set_dim([b, h, sq, 1])
        stats.set_stride(self.stats_stride(b))
        if x.uses_ragged_stats:
            self.attach(stats, self.offset("offset_stats", b, odt), "stats", mult)

    def fp8_backward(self) -> None:
        """``create_graph_fp8_bwd`` (fused_attn_fp8.cu), per-tensor scaling: O in o dtype, dO in
        the gradient type, dQ/dK/dV in ``dqkv_dtype``; ``Descale_O`` a constant 1.0 for current
        scaling with O in F16, ``Scale_dQ/dK/dV`` real for delayed and 1.0 for current; outputs
        amax_dQ/dK/dV/dP. Deterministic only with cuDNN >= 9.19; no max_total_seq_len."""
        x, dt, cd = self.d, self.dt, self.cudnn
        b, h, hg, dqk, dv = x.graph_batch_size_bwd, x.h, x.hg, x.d_qk, x.d_v
        sq, skv = x.graph_max_seqlen_q, x.graph_max_seqlen_kv
        io = _dtype(cd, x.qkv_dtype)
        q, k, v, o, d_o, stats, off = self._bwd_inputs(
            "Stats", (io, io, io, _dtype(cd, x.o_dtype), _dtype(cd, x.do_dtype)))
        qs, ks, vs = (t.get_stride() for t in (q, k, v))
        attn_scale = self.scalar("attn_scale", by_value=True)
        descale_q = self.scalar("Descale_q")
        like = self.g.tensor_like
        descale_k, descale_v = like(descale_q, "Descale_q"), like(descale_q, "Descale_v")
        descale_s, scale_s = like(descale_q, "Descale_s"), like(descale_q, "Scale_s")
        descale_dp, scale_dp = like(descale_q, "Descale_dP"), like(descale_q, "Scale_dP")
        o_in_f16 = x.o_dtype in ("fp16", "bf16")
        descale_o = self.one() if x.fp8_current and o_in_f16 else like(descale_q, "Descale_O")
        descale_do = like(descale_q, "Descale_dO")
        if x.fp8_delayed:
            scale_dq, scale_dk = like(descale_q, "Scale_dQ"), like(descale_q, "Scale_dK")
            scale_dv = like(descale_q, "Scale_dV")
        else:
            scale_dq, scale_dk, scale_dv = self.one(), self.one(), self.one()
        kw: dict[str, Any] = {"attn_scale": attn_scale}
        self.masking(kw, fp8=True)
        if x.cudnn_version >= 91900:
            kw["use_deterministic_algorithm"] = x.deterministic
        self.padding(kw, b, fwd=False)
        self.dropout(kw)
        self.sink(kw, bwd=True)
        outs = self.g.sdpa_fp8_backward(
            q, k, v, o, d_o, stats, descale_q, descale_k, descale_v, descale_o, descale_do,
            descale_s, descale_dp, scale_s, scale_dq, scale_dk, scale_dv, scale_dp,
            name="sdpa_fp8_backward", **kw,
        )  # fmt: skip
        dq, dk, dv_ = outs[:3]
        dqkv = _dtype(cd, x.dqkv_dtype)
        for t, dim, stride in ((dq, [b, h, sq, dqk], qs), (dk, [b, hg, skv, dqk], ks),
                               (dv_, [b, hg, skv, dv], vs)):  # fmt: skip
            t.set_output(True).set_dim(dim).set_stride(stride).set_data_type(dqkv)
        if x.ragged_q:
            dq.set_ragged_offset(off["q"])
        if x.ragged_kv:
            dk.set_ragged_offset(off["k"])
            dv_.set_ragged_offset(off["v"])
        for a in outs[3:7]:
            a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1])
            a.set_data_type(dt.FLOAT)

    def build(self, which: str) -> None:
        if self.d.fp8:
            self.fp8_forward() if which == "fwd" else self.fp8_backward()
        else:
            self.f16_forward() if which == "fwd" else self.f16_backward()
