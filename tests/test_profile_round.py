"""bench/profile_round.py: kernels per round from compiled HLO, on the tiny pair and by hand."""

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
