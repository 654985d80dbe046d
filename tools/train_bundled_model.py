#!/usr/bin/env python3
"""Train tandem's bundled model: a small Llama on the King James Bible.

Run by hand (not in CI); needs torch, transformers, tokenizers, safetensors:

    nice -n 10 python tools/train_bundled_model.py --out models/tandem-kjv

What it does, deterministically for a given seed:
  1. Reads the KJV text of Debian's `bible-kjv-text` package through the
     `bible` program of `bible-kjv` (`bible -f Gen1:1-Rev22:21`), one verse per
     line; a chapter is one document. Every 50th chapter is held out for
     validation (~2%).
  2. Trains a byte-level BPE tokenizer with Hugging Face `tokenizers`
     (Llama-3-style split regex + ByteLevel, vocab 4096, special tokens
     <|endoftext|> (eos), <|begin_of_text|> (bos), <|im_start|>, <|im_end|>).
  3. Trains LlamaForCausalLM (float32, GQA, tied embeddings) with AdamW and a
     cosine LR on random windows of the stream "<bos> chapter <eos> ...":
     windows of 256 tokens, then the last `--long-frac` of the steps on
     windows of 1024 tokens so the whole context is trained.
     The cosine schedule follows wall-clock progress through `--minutes` (the
     training machine is shared, so its speed varies and a step-count schedule
     would end early or late); `--steps N` makes the schedule step-based
     instead, for an exact, machine-independent rerun (the log prints N).
     Initialisation and data order are seeded either way.
  4. Saves a Hugging Face directory: config.json, model.safetensors,
     generation_config.json, tokenizer.json, tokenizer_config.json (with a
     ChatML chat_template), and prints losses and greedy samples.
"""
import argparse
import json
import math
import os
import random
import subprocess
import sys
import time

import numpy as np
import torch

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, AutoTokenizer,
                          PreTrainedTokenizerFast)

EOS = "<|endoftext|>"
BOS = "<|begin_of_text|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIALS = [EOS, BOS, IM_START, IM_END]  # ids 0, 1, 2, 3

# Llama-3's pre-tokenizer split pattern.
SPLIT_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


def read_kjv():
    """Returns a list of chapters, each a list of verse strings."""
    out = subprocess.run(["bible", "-f", "-m", "8192", "Gen1:1-Rev22:21"],
                         check=True, capture_output=True, text=True).stdout
    chapters, cur_key, cur = [], None, []
    for line in out.splitlines():
        if not line.strip():
            continue
        ref, text = line.split(" ", 1)
        key = ref.split(":")[0]  # e.g. "Ge1"
        if key != cur_key and cur:
            chapters.append(cur)
            cur = []
        cur_key = key
        cur.append(text.strip())
    if cur:
        chapters.append(cur)
    return chapters


def build_tokenizer(texts, vocab_size):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # add_special_tokens=True prepends BOS, as Llama 3 does.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)])
    for i, s in enumerate(SPECIALS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    return tok


def encode_stream(tok, chapters):
    ids = []
    for ch in chapters:
        ids.append(1)  # BOS
        ids.extend(tok.encode("\n".join(ch), add_special_tokens=False).ids)
        ids.append(0)  # EOS
    return np.array(ids, dtype=np.int64)


@torch.no_grad()
def evaluate(model, data, seq, max_windows=None):
    model.eval()
    n = (len(data) - 1) // seq
    if max_windows:
        n = min(n, max_windows)
    tot, cnt = 0.0, 0
    for i in range(0, n, 8):
        b = min(8, n - i)
        x = torch.from_numpy(np.stack([data[(i + j) * seq:(i + j) * seq + seq + 1] for j in range(b)]))
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)),
                                                 x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / cnt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="models/tandem-kjv")
    ap.add_argument("--minutes", type=float, default=35.0)
    ap.add_argument("--steps", type=int, default=0, help="fixed step count (0: fit --minutes)")
    ap.add_argument("--long-frac", type=float, default=0.1, help="fraction of steps at 1024 tokens")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--layers", type=int, default=5)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--report", default="/tmp/train_report.json")
    ap.add_argument("--init-from", default=None,
                    help="start from the weights of a saved model directory (a continuation run; "
                         "fresh optimizer, warmup and cosine)")
    ap.add_argument("--warmup", type=int, default=50)
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    t_start = time.time()

    chapters = read_kjv()
    val_ch = [c for i, c in enumerate(chapters) if i % 50 == 25]
    train_ch = [c for i, c in enumerate(chapters) if i % 50 != 25]
    log(f"chapters: {len(chapters)} (train {len(train_ch)}, held out {len(val_ch)}); "
        f"verses {sum(map(len, chapters))}")

    tok = build_tokenizer(("\n".join(c) for c in train_ch), args.vocab)
    train = encode_stream(tok, train_ch)
    val = encode_stream(tok, val_ch)
    log(f"tokenizer vocab {tok.get_vocab_size()}; train tokens {len(train)}, val tokens {len(val)}")

    os.makedirs(args.out, exist_ok=True)
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                     pad_token=EOS, add_bos_token=True, add_eos_token=False,
                                     model_max_length=1024)
    hf_tok.chat_template = CHAT_TEMPLATE
    hf_tok.save_pretrained(args.out)
    # Keep the chat template inside tokenizer_config.json (one file fewer for
    # other readers); transformers reads it from there too.
    tc_path = os.path.join(args.out, "tokenizer_config.json")
    with open(tc_path) as f:
        tc = json.load(f)
    tc["chat_template"] = CHAT_TEMPLATE
    with open(tc_path, "w") as f:
        json.dump(tc, f, indent=2)
        f.write("\n")
    jinja = os.path.join(args.out, "chat_template.jinja")
    if os.path.exists(jinja):
        os.remove(jinja)
    with open(os.path.join(args.out, "tokenizer.json")) as f:
        pp = json.load(f)["post_processor"]
    assert "begin_of_text" in json.dumps(pp), pp

    H = args.hidden
    cfg = LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=H, intermediate_size=688 if H == 256 else (H * 43 // 16) // 16 * 16,
        num_hidden_layers=args.layers, num_attention_heads=H // 32, num_key_value_heads=2, head_dim=32,
        hidden_act="silu", max_position_embeddings=1024, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False,
        bos_token_id=1, eos_token_id=0, pad_token_id=0, torch_dtype="float32")
    model = LlamaForCausalLM(cfg)
    if args.init_from:
        init = LlamaForCausalLM.from_pretrained(args.init_from, torch_dtype=torch.float32)
        model.load_state_dict(init.state_dict())
        del init
        log(f"initialised from {args.init_from}")
    model.config._attn_implementation = "sdpa"
    nparams = sum(p.numel() for p in model.parameters())
    log(f"model: {args.layers} layers, hidden {H}, params {nparams}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    warmup = args.warmup
    gen = np.random.default_rng(args.seed)

    def batch(seq):
        b = args.batch_tokens // seq
        starts = gen.integers(0, len(train) - seq - 1, size=b)
        return torch.from_numpy(np.stack([train[s:s + seq + 1] for s in starts]))

    budget = args.minutes * 60
    # Progress through the schedule: by step with --steps, else by wall time
    # (the machine is shared, so its speed varies; the cosine then still ends
    # on time). Leave ~90 s for the final evaluation and saving.
    train_budget = budget - (time.time() - t_start) - 90
    t_train = time.time()

    def progress(step):
        if args.steps:
            return step / args.steps
        return (time.time() - t_train) / train_budget

    step, losses, history = 0, [], []
    long_start = None
    next_eval = 1 / 8
    model.train()
    while progress(step) < 1.0:
        p = progress(step)
        if long_start is None and p >= 1 - args.long_frac:
            long_start = step
            log(f"switching to 1024-token windows at step {step}")
        seq = 1024 if long_start is not None else 256
        if step < warmup:
            lr = args.lr * (step + 1) / warmup
        else:
            p0 = warmup / args.steps if args.steps else 0.0
            q = min(1.0, max(0.0, (p - p0) / max(1e-9, 1 - p0)))
            lr = args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * q)))
        for g in opt.param_groups:
            g["lr"] = lr
        x = batch(seq)
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        step += 1
        el = time.time() - t_train
        if step % 50 == 0:
            log(f"step {step} seq {seq} lr {lr:.2e} loss {np.mean(losses[-50:]):.4f} "
                f"elapsed {el:.0f}s progress {progress(step):.3f}")
        if progress(step) >= next_eval:
            next_eval += 1 / 8
            vl = evaluate(model, val, 256)
            history.append({"step": step, "train_loss_avg50": float(np.mean(losses[-50:])), "val_loss": vl})
            log(f"  held-out loss {vl:.4f} (ppl {math.exp(vl):.2f})")
        if time.time() - t_start > 1.3 * budget:
            log(f"hard time stop at step {step}")
            break
    log(f"trained {step} steps; 1024-token windows from step {long_start} "
        f"(rerun step-wise with --steps {step} --long-frac {(step - (long_start or step)) / step:.4f})")
    train_time = time.time() - t_train
    n_long = max(0, step - (long_start or step))
    tokens_seen = (step - n_long) * (args.batch_tokens // 256) * 256 + n_long * (args.batch_tokens // 1024) * 1024

    log("final evaluation")
    val256 = evaluate(model, val, 256)
    val1024 = evaluate(model, val, 1024)
    train256 = evaluate(model, train, 256, max_windows=100)
    log(f"held-out loss @256 {val256:.4f} (ppl {math.exp(val256):.2f}), @1024 {val1024:.4f} "
        f"(ppl {math.exp(val1024):.2f}); train loss @256 (first 100 windows) {train256:.4f}")

    model.config._attn_implementation = "eager"
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=0, pad_token_id=0,
                                               do_sample=False, max_new_tokens=128)
    model.save_pretrained(args.out, safe_serialization=True)

    # Samples from the saved directory.
    m2 = LlamaForCausalLM.from_pretrained(args.out, torch_dtype=torch.float32, attn_implementation="eager")
    t2 = AutoTokenizer.from_pretrained(args.out)
    samples = {}
    for prompt in ["In the beginning", "And the LORD said unto Moses", "Blessed are the"]:
        ids = t2(prompt, return_tensors="pt", add_special_tokens=True)
        g = m2.generate(**ids, do_sample=False, max_new_tokens=60)
        samples[prompt] = t2.decode(g[0, ids["input_ids"].shape[1]:], skip_special_tokens=False)
        log(f"SAMPLE {prompt!r} -> {samples[prompt]!r}")

    report = dict(params=nparams, layers=args.layers, hidden=H, steps=step, long_start=long_start,
                  train_time_s=train_time, total_time_s=time.time() - t_start, tokens_seen=tokens_seen,
                  train_tokens=len(train), val_tokens=len(val), val_loss_256=val256, val_loss_1024=val1024,
                  train_loss_256=train256, train_loss_last50=float(np.mean(losses[-50:])), history=history,
                  samples=samples, args=vars(args), chapters=len(chapters), val_chapters=len(val_ch),
                  torch=torch.__version__)
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()
