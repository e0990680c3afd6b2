"""bench/profile_round.py: kernels per round from compiled HLO, on the tiny pair and by hand."""

import gzip
import json
import os
import sys

import pytest

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "bench"))
import profile_round  # noqa: E402  (bench/ is not a package)

# A loop whose body holds 2 fusions, a dot, a call of 1 copy, a conditional (2 or 1 kernels), a
# nested loop (1 fusion in its body, 1 compare in its condition) and free ops; its condition
# holds 1 compare. Outside it: 1 fusion.
HLO = """HloModule jit_decode, is_scheduled=true

%fused_a (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %n = f32[4]{0} negate(%p)
}

%copy_it (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %c = f32[4]{0} copy(%p)
}

%big (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  %x = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_a
  ROOT %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
}

%small (p: f32[4]) -> f32[4] {
  %p = f32[4]{0} parameter(0)
  ROOT %x = f32[4]{0} fusion(%p), kind=kLoop, calls=%fused_a
}

%inner_body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %w = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused_a
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %w)
}

%inner_cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[4]{0} get-tuple-element(%t), index=1
  %a = f32[4]{0} fusion(%v), kind=kLoop, calls=%fused_a
  %b = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_a
  %d = f32[4]{0} dot(%a, %b), lhs_contracting_dims={0}, rhs_contracting_dims={0}
  %e = f32[4]{0} call(%d), to_apply=%copy_it
  %p = pred[] constant(true)
  %f = f32[4]{0} conditional(%p, %e, %e), true_computation=%big, false_computation=%small
  %n = (s32[], f32[4]{0}) tuple(%i, %f)
  %g = (s32[], f32[4]{0}) while(%n), condition=%inner_cond, body=%inner_body
  %h = f32[4]{0} get-tuple-element(%g), index=1
  %bc = f32[2,2]{1,0} bitcast(%h)
  ROOT %r = (s32[], f32[4]{0}) tuple(%i, %h)
}

%cond (t: (s32[], f32[4])) -> pred[] {
  %t = (s32[], f32[4]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %k = s32[] constant(8)
  ROOT %lt = pred[] compare(%i, %k), direction=LT
}

ENTRY %main (x: f32[4]) -> f32[4] {
  %x = f32[4]{0} parameter(0)
  %y = f32[4]{0} fusion(%x), kind=kLoop, calls=%fused_a
  %z = s32[] constant(0)
  %t = (s32[], f32[4]{0}) tuple(%z, %y)
  %w = (s32[], f32[4]{0}) while(%t), condition=%cond, body=%body, metadata={op_name="a (b)"}
  ROOT %o = f32[4]{0} get-tuple-element(%w), index=1
}
"""


def test_kernel_count_of_a_hand_written_loop():
  result = profile_round.round_kernels(HLO)
  # body: 2 fusions + dot + copy (call) + 2 (larger branch) + 1 + 1 (nested loop); cond: compare.
  assert result["kernels"] == 9
  assert result["nested_loops"] == 1 and result["outside_loop"] == 1
  assert result["by_opcode"] == {"fusion": 5, "compare": 2, "dot": 1, "copy": 1}


def test_loop_free_module_is_refused():
  with pytest.raises(ValueError, match="no while loop"):
    profile_round.round_kernels(HLO.replace("while(%t), condition=%cond, body=%body",
                                            "copy(%t)"))


def test_tiny_pair_ar_round_has_fewer_kernels_than_the_tree_round(tmp_path):
  record = profile_round.profile_round("tiny", budget=16, length=32)
  ar, tree = record["methods"]["ar"], record["methods"]["jetflow/16"]
  assert 0 < ar["kernels"] < tree["kernels"]
  assert ar["by_opcode"] and sum(tree["by_opcode"].values()) == tree["kernels"]
  assert record["backend"] == "cpu" and record["committed_length"] == 32
  json.dumps(record)  # what the script writes


def test_time_by_op_groups_a_traces_kernels_by_source_per_round(tmp_path):
  hlo = """HloModule m
ENTRY %main (p: f32[4]) -> f32[4] {
  %w = f32[4]{0} while(%t), condition=%c, body=%b, metadata={op_name="jit(decode)/while"}
  %d.1 = f32[1,8]{1,0} dot(%x, %y), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %f.1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%g, metadata={op_name="jit(decode)/while/body/verify/Qwen3/layers_3/mlp/down_proj/dot_general"}
  %f.2 = f32[4]{0} fusion(%p), kind=kLoop, calls=%g, metadata={op_name="jit(decode)/while/body/verify/Qwen3/layers_12/mlp/down_proj/add"}
}
"""
  events = [dict(ph="X", name="w", dur=1000), dict(ph="X", name="d.1", dur=300),
            dict(ph="X", name="f.1", dur=100), dict(ph="X", name="f.2", dur=500),
            dict(ph="X", name="ThunkExecutor::Execute", dur=9000), dict(ph="i", name="f.1")]
  trace = tmp_path / "plugins" / "profile" / "run"
  trace.mkdir(parents=True)
  with gzip.open(trace / "host.trace.json.gz", "wt") as f:
    json.dump({"traceEvents": events}, f)
  groups = profile_round.time_by_op(str(tmp_path), hlo, rounds=2)
  assert [g["source"] for g in groups] == ["verify/Qwen3/layers_*/mlp/down_proj", "(dot f32[1,8])"]
  assert groups[0]["ms_per_round"] == pytest.approx(0.3) and groups[0]["kernels_per_round"] == 1
  assert groups[0]["busiest_opcode"] == "fusion" and groups[1]["busiest_opcode"] == "dot"
  assert sum(g["share"] for g in groups) == pytest.approx(1.0)  # the while's span is not a kernel
