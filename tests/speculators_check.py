"""Runs inside speculators' own venv (`scripts/speculators_venv.py`): loads exported heads with
speculators 0.9.0 and computes their draft logits with its own modules.

  python speculators_check.py REQUEST.json RESULT.npz

REQUEST holds `cases`: {name, dir, target, tokens, anchor, causal}. For each case the head is
loaded with `DFlashSpeculatorConfig` / `DFlashDraftModel.from_pretrained` (its loading info
kept), the target's hidden states come from transformers' Qwen3 on `tokens`, and
`DFlashDraftModel._backbone_forward` (speculators' training forward, anchors picked from the
loss mask: one valid position, the anchor) gives the block's logits. A causal (jetspec) case
is run by the same class: the jetspec type's layers are the DFlash decoder layers, and its
causal in-block mask is speculators' anchored-block mask with `sliding_window_non_causal=False`
on layers marked sliding with a window wider than the sequence.

RESULT holds, per case, `NAME/logits` (`[block, draft_vocab]`, float32), `NAME/target_ids`
(the draft vocabulary's target ids from `d2t`, or empty) and `NAME/info` (JSON: missing,
unexpected and mismatched keys, the config's type and fields).
"""

import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig


def as_dflash(directory: str, causal: bool, scratch: str) -> str:
  """The export itself, or (causal) a copy whose config runs DFlash's layers causally."""
  if not causal:
    return directory
  with open(os.path.join(directory, "config.json")) as f:
    raw = json.load(f)
  assert raw["speculators_model_type"] == "jetspec", raw["speculators_model_type"]
  raw.pop("kd_temperature")
  raw.update(speculators_model_type="dflash", architectures=["DFlashDraftModel"],
             sliding_window_non_causal=False, sample_from_anchor=False)
  raw["speculators_config"]["algorithm"] = "dflash"
  layers = raw["transformer_layer_config"]
  layers.update(layer_types=["sliding_attention"] * layers["num_hidden_layers"],
                use_sliding_window=True, sliding_window=1 << 20)
  out = os.path.join(scratch, os.path.basename(directory))
  os.makedirs(out)
  with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(raw, f)
  shutil.copy(os.path.join(directory, "model.safetensors"), out)
  return out


def run_case(case: dict, scratch: str) -> tuple[np.ndarray, np.ndarray, dict]:
  directory = as_dflash(case["dir"], case["causal"], scratch)
  config = DFlashSpeculatorConfig.from_pretrained(directory)
  config.transformer_layer_config._attn_implementation = "eager"  # CPU: no flex compile
  model, info = DFlashDraftModel.from_pretrained(directory, config=config,
                                                 output_loading_info=True)
  model.load_verifier_weights()  # what from_pretrained does when it returns the model alone
  model = model.float().eval()

  target = AutoModelForCausalLM.from_pretrained(case["target"], dtype=torch.float32).eval()
  anchor, block = case["anchor"], config.block_size
  tokens = list(case["tokens"][:anchor + 1]) + [0] * (block + 1)  # rows after the anchor: unread
  input_ids = torch.tensor([tokens])
  with torch.no_grad():
    hidden = target(input_ids, output_hidden_states=True).hidden_states
    taps = torch.cat([hidden[i] for i in config.aux_hidden_state_layer_ids], dim=-1)
    loss_mask = torch.zeros_like(input_ids)
    loss_mask[0, anchor] = 1
    _, logits, _, _, _ = model._backbone_forward(
        hidden_states=taps, input_ids=input_ids, loss_mask=loss_mask,
        verifier_last_hidden_states=hidden[-1], document_ids=torch.zeros_like(input_ids),
        max_anchors=1)
  target_ids = (np.arange(len(model.d2t)) + model.d2t.numpy() if model.d2t is not None
                else np.zeros(0, np.int64))
  report = {key: sorted(value) for key, value in info.items() if key != "error_msgs"}
  report.update(type=config.speculators_model_type, draft_vocab_size=config.draft_vocab_size,
                aux_hidden_state_layer_ids=config.aux_hidden_state_layer_ids,
                mask_token_id=config.mask_token_id, block_size=config.block_size,
                verifier=config.speculators_config.verifier.name_or_path)
  return logits[0].float().numpy(), target_ids, report


def main(request_path: str, result_path: str) -> None:
  with open(request_path) as f:
    cases = json.load(f)["cases"]
  out = {}
  with tempfile.TemporaryDirectory() as scratch:
    for case in cases:
      logits, target_ids, report = run_case(case, scratch)
      out[f"{case['name']}/logits"] = logits
      out[f"{case['name']}/target_ids"] = target_ids
      out[f"{case['name']}/info"] = np.array(json.dumps(report))
  np.savez(result_path, **out)


if __name__ == "__main__":
  main(*sys.argv[1:])
