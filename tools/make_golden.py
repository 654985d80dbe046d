#!/usr/bin/env python3
"""Golden fixtures for tandem's engine test, computed with Hugging Face transformers.

Run by hand from the repository root (needs torch, transformers, tokenizers,
safetensors; CI does not — the fixtures are committed):

    python tools/make_golden.py                 # all three models
    python tools/make_golden.py --only tiny     # just the two random tiny models
    python tools/make_golden.py --only kjv      # just the bundled model

Writes, under tests/fixtures/golden/:
  tiny-qwen2/  config.json, model.safetensors (f32), generation_config.json, golden.json
               Qwen2ForCausalLM, random weights (seeded): GQA 4 heads / 2 kv heads,
               q/k/v bias, tied embeddings, default RoPE (theta 10000).
  tiny-llama/  config.json, model.safetensors (f32), generation_config.json, golden.json
               LlamaForCausalLM, random weights (seeded): 4 heads / 1 kv head,
               head_dim 32 != hidden/heads, untied embeddings, Llama-3 RoPE scaling;
               its config.json is rewritten in the transformers-4 layout
               (`rope_theta` + `rope_scaling`) and the golden data is computed from
               the reloaded directory, so both layouts are known to mean the same.
  tandem-kjv/  golden.json only: the bundled model is read from models/tandem-kjv.

golden.json:
  {"model_dir": "<path relative to the repository root>",
   "dtype": "float32", "attn_implementation": "eager", "ignore_eos": true,
   "max_new_tokens": 64, "logits_round": "6 significant digits",
   "cases": [{"name": ..., "prompt_ids": [...],
              "logits_positions": [...],        # prompt positions (0-based)
              "logits": [[vocab floats], ...],  # one row per listed position
              "greedy_ids": [64 ids],           # continuation only
              "greedy_margins": [64 floats]},   # top1 - top2 logit at each greedy step
             ...]}
  greedy_ids come from model.generate(do_sample=False, max_new_tokens=64,
  min_new_tokens=64) with eos disabled (eos_token_id=None): generation runs past
  eos, exactly 64 tokens. For the tiny models, random prompts are redrawn until
  every greedy step wins by at least 2e-3 (so a 1e-3 logit tolerance cannot flip
  a token). For prompts of <= 100 tokens they are cross-checked against an
  argmax loop over full (cache-free) forward passes. The bundled model's cases also carry "prompt_text"
  and "add_special_tokens" (whether BOS was prepended by the tokenizer).
"""
import argparse
import json
import os
import sys

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOLDEN = os.path.join(ROOT, "tests", "fixtures", "golden")
N_NEW = 64


def r6(x):
    return float(f"{x:.6g}")


def randomize(model, seed, std):
    """Random weights that make the test meaningful: non-zero biases, norm weights != 1."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(std * torch.randn(p.shape, generator=g))


def save_model_dir(model, out_dir):
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)


def load(cls, model_dir):
    m = cls.from_pretrained(model_dir, torch_dtype=torch.float32, attn_implementation="eager")
    m.eval()
    return m


@torch.no_grad()
def run_case(model, prompt_ids, positions):
    x = torch.tensor([prompt_ids])
    logits = model(input_ids=x).logits[0]
    rows = [[r6(v) for v in logits[p].tolist()] for p in positions]

    gc = GenerationConfig(do_sample=False, max_new_tokens=N_NEW, min_new_tokens=N_NEW,
                          eos_token_id=None, bos_token_id=None, pad_token_id=0,
                          temperature=None, top_p=None, top_k=None,
                          output_logits=True, return_dict_in_generate=True)
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), generation_config=gc)
    greedy = out.sequences[0, len(prompt_ids):].tolist()
    assert len(greedy) == N_NEW, len(greedy)
    margins = []
    for step_logits in out.logits:
        top2 = torch.topk(step_logits[0].float(), 2).values
        margins.append(r6((top2[0] - top2[1]).item()))

    # Cross-check: argmax over full forward passes, no KV cache (short prompts
    # only: for long ones it costs minutes on a small CPU).
    if len(prompt_ids) <= 100:
        seq = list(prompt_ids)
        for _ in range(N_NEW):
            seq.append(int(model(input_ids=torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
        if seq[len(prompt_ids):] != greedy:
            print("WARNING: generate() and the cache-free argmax loop disagree", file=sys.stderr)
    return rows, greedy, margins


def write_golden(path, model_dir_rel, cases, extra=None):
    doc = {"model_dir": model_dir_rel, "model_dir_relative_to": "repository root",
           "dtype": "float32", "attn_implementation": "eager", "ignore_eos": True,
           "max_new_tokens": N_NEW, "logits_round": "6 significant digits",
           "generator": f"tools/make_golden.py; transformers {transformers.__version__}, "
                        f"torch {torch.__version__}"}
    if extra:
        doc.update(extra)
    doc["cases"] = cases
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print(f"wrote {os.path.relpath(path, ROOT)}: {os.path.getsize(path) / 1e6:.2f} MB, "
          f"{len(cases)} cases, min greedy margin "
          f"{min(min(c['greedy_margins']) for c in cases):.3g}")


MIN_MARGIN = 2e-3  # random prompts are redrawn until every greedy step wins by this much


def tiny_cases(model, vocab, seed):
    g = torch.Generator().manual_seed(seed)
    cases = []
    for i, n in enumerate([1, 2, 7, 16, 37, 70]):
        for attempt in range(50):
            ids = torch.randint(0, vocab, (n,), generator=g).tolist()
            positions = list(range(n))
            rows, greedy, margins = run_case(model, ids, positions)
            if min(margins) >= MIN_MARGIN:
                break
        cases.append({"name": f"random_{n}", "prompt_ids": ids, "logits_positions": positions,
                      "logits": rows, "greedy_ids": greedy, "greedy_margins": margins})
    return cases


def make_tiny_qwen2():
    out = os.path.join(GOLDEN, "tiny-qwen2")
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=160, hidden_act="silu",
                      max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                      use_sliding_window=False)
    m = Qwen2ForCausalLM(cfg)
    randomize(m, seed=101, std=0.15)
    m.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    save_model_dir(m, out)
    m = load(Qwen2ForCausalLM, out)
    assert m.model.layers[0].self_attn.q_proj.bias is not None
    write_golden(os.path.join(out, "golden.json"), "tests/fixtures/golden/tiny-qwen2",
                 tiny_cases(m, 512, seed=7))


def make_tiny_llama():
    out = os.path.join(GOLDEN, "tiny-llama")
    torch.manual_seed(0)
    rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=32, intermediate_size=176, hidden_act="silu",
                      max_position_embeddings=512, rms_norm_eps=1e-5, rope_parameters=rope,
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    m = LlamaForCausalLM(cfg)
    randomize(m, seed=202, std=0.15)
    m.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    save_model_dir(m, out)
    ref = load(LlamaForCausalLM, out)
    x = torch.tensor([list(range(3, 103))])
    with torch.no_grad():
        ref_logits = ref(input_ids=x).logits

    # Rewrite config.json in the transformers-4 layout: rope_theta + rope_scaling.
    cpath = os.path.join(out, "config.json")
    with open(cpath) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters")
    c["rope_theta"] = rp.pop("rope_theta")
    c["rope_scaling"] = rp
    with open(cpath, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")
    m = load(LlamaForCausalLM, out)
    assert m.config.rope_parameters["rope_type"] == "llama3", m.config.rope_parameters
    assert m.lm_head.weight.data_ptr() != m.model.embed_tokens.weight.data_ptr()
    sd = load_file(os.path.join(out, "model.safetensors"))
    assert "lm_head.weight" in sd
    with torch.no_grad():
        assert torch.equal(m(input_ids=x).logits, ref_logits), "v4 config layout changed the model"
        # Llama-3 scaling must matter at these positions (else the fixture would not test it).
        plain = LlamaConfig(**{k: v for k, v in c.items() if k not in ("rope_scaling",)})
        plain.rope_parameters = {"rope_type": "default", "rope_theta": c["rope_theta"]}
        pm = LlamaForCausalLM(plain).eval()
        pm.load_state_dict(m.state_dict())
        pm.config._attn_implementation = "eager"
        d = (pm(input_ids=x).logits - ref_logits).abs().max().item()
        print(f"tiny-llama: llama3 rope scaling changes logits by up to {d:.3g}")
        assert d > 1e-2
    write_golden(os.path.join(out, "golden.json"), "tests/fixtures/golden/tiny-llama",
                 tiny_cases(m, 512, seed=8))


def make_tiny_llama_bias():
    """Llama with attention_bias=True: q/k/v *and* o_proj carry a bias."""
    out = os.path.join(GOLDEN, "tiny-llama-bias")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, hidden_act="silu",
                      max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=True, attention_bias=True, mlp_bias=False,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    m = LlamaForCausalLM(cfg)
    randomize(m, seed=303, std=0.15)
    m.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    save_model_dir(m, out)
    m = load(LlamaForCausalLM, out)
    assert m.model.layers[0].self_attn.o_proj.bias is not None
    write_golden(os.path.join(out, "golden.json"), "tests/fixtures/golden/tiny-llama-bias",
                 tiny_cases(m, 512, seed=9))


def make_kjv():
    model_dir_rel = "models/tandem-kjv"
    model_dir = os.path.join(ROOT, model_dir_rel)
    out = os.path.join(GOLDEN, "tandem-kjv")
    os.makedirs(out, exist_ok=True)
    m = load(LlamaForCausalLM, model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    import subprocess
    kjv = subprocess.run(["bible", "-f", "-m", "8192", "Ps119:1-176", "Ge24:1-67"], check=True,
                         capture_output=True, text=True).stdout
    verses = [l.split(" ", 1)[1] for l in kjv.splitlines() if l.strip()]
    ps119 = "\n".join(verses[:176])   # Psalm 119
    ge24 = "\n".join(verses[176:])    # Genesis 24
    long_ids = tok(ps119, add_special_tokens=True)["input_ids"]
    long2_ids = tok(ge24, add_special_tokens=True)["input_ids"]
    prompts = [
        ("single_bos", None, [tok.bos_token_id], False),
        ("in_the_beginning", "In the beginning", None, True),
        # Text prompts may list candidates: the first whose greedy steps all win
        # by MIN_MARGIN is used ("And the LORD said unto Moses" has a step won
        # by 1.4e-4 with the committed weights).
        ("lord_spake_unto_moses", ["And the LORD said unto Moses", "And the LORD spake unto Moses, saying",
                                   "And Moses said unto the LORD"], None, True),
        ("no_bos_mid_verse", " and the children of Israel went", None, False),
        ("chatml", None, None, False),
        ("psalm119_350", None, long_ids[:350], True),
        ("genesis24_950", None, long2_ids[:950], True),
    ]
    cases = []
    for name, text, ids, add_special in prompts:
        if isinstance(text, list):
            for cand in text:
                ids = tok(cand, add_special_tokens=add_special)["input_ids"]
                _, _, margins = run_case(m, ids, [len(ids) - 1])
                if min(margins) >= MIN_MARGIN:
                    break
                print(f"  {name}: skipping {cand!r} (greedy margin {min(margins):.3g})")
            text = cand
        if name == "chatml":
            text = tok.apply_chat_template([{"role": "user", "content": "Who made the heaven and the earth?"}],
                                           tokenize=False, add_generation_prompt=True)
            ids = tok(text, add_special_tokens=False)["input_ids"]
        elif ids is None:
            ids = tok(text, add_special_tokens=add_special)["input_ids"]
        else:
            text = tok.decode(ids, skip_special_tokens=False)
        n = len(ids)
        positions = list(range(max(0, n - 3), n))
        rows, greedy, margins = run_case(m, ids, positions)
        case = {"name": name, "prompt_text": text, "add_special_tokens": add_special,
                "prompt_ids": ids, "logits_positions": positions, "logits": rows,
                "greedy_ids": greedy, "greedy_margins": margins,
                "greedy_text": tok.decode(greedy, skip_special_tokens=False)}
        print(f"  {name}: {n} prompt tokens -> {case['greedy_text'][:100]!r}")
        cases.append(case)
    assert any(len(c["prompt_ids"]) > 300 for c in cases)
    write_golden(os.path.join(out, "golden.json"), model_dir_rel, cases)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", choices=["tiny", "tiny-llama-bias", "kjv"], default=None)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.only in (None, "tiny"):
        make_tiny_qwen2()
        make_tiny_llama()
    if args.only in (None, "tiny", "tiny-llama-bias"):
        make_tiny_llama_bias()
    if args.only in (None, "kjv"):
        make_kjv()


if __name__ == "__main__":
    main()
