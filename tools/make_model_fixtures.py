#!/usr/bin/env python3
"""Generates the committed fixtures of tests/unit/model (run by hand, not in CI).

    /opt/trainvenv/bin/python tools/make_model_fixtures.py [--out tests/fixtures/model]

Writes, under the output folder:
  tokenizers/gpt2_style/tokenizer.json    byte-level BPE, GPT-2 regex inside the
                                          ByteLevel pre-tokenizer, merges stored as
                                          legacy "a b" strings
  tokenizers/llama3_style/tokenizer.json  Llama-3 regex as a Split inside a Sequence
                                          pre-tokenizer, merges as [a, b] pairs,
                                          ignore_merges, extra vocab entries that no
                                          merge reaches
  tokenizers/cases.json                   expected ids / decoded strings from the
                                          Hugging Face `tokenizers` library
  models/<variant>/                       tiny random Llama-family checkpoints
                                          (config.json, generation_config.json,
                                          safetensors in f32 / f16 / bf16, sharded
                                          and not) and expected.json with values
                                          of selected tensors after conversion to f32
  configs/<variant>/config.json           config-only variants (rope flavours,
                                          Mistral, head_dim)

Everything is deterministic (fixed seeds), small (< 1 MB in all), and the
tokenizers are trained here with `tokenizers` itself, so the C++ tokenizer is
checked against the reference implementation, not against our reading of it.
If models/tandem-kjv/tokenizer.json exists, its cases are added as well.
"""
import argparse
import glob
import json
import os
import shutil

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

GPT2_REGEX = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
            "<|end_header_id|>"]

# Multi-byte text mixed into the training corpus so that merges exist inside
# and across multi-byte characters (the detokenizer test needs tokens that end
# in the middle of a UTF-8 sequence).
EXTRA_TEXT = [
    "日本語の文章です。東京は大きな都市です。" * 3,
    "中文字符测试，你好世界！" * 3,
    "Ünïcödé façade naïve café résumé São Paulo Zürich" * 3,
    "Привет, как дела? Всё хорошо." * 3,
    "😀😀 👍🏽 👨‍👩‍👧‍👦 🇺🇸 ❤️ 🎉🎉" * 3,
    "Ελληνικά γράμματα και αριθμοί ١٢٣ ٤٥٦" * 2,
    "don't won't they're I've we'll she'd IT'S" * 4,
    "tabs\tand\t\tnewlines\n\n  spaced   out    text   \n" * 3,
    "1234567890 3.14159 2026-11-29 $100,000" * 3,
]

CASES = [
    "",
    " ",
    "  ",
    "Hello world",
    "Hello, world!",
    " leading space",
    "trailing space ",
    "trailing spaces   ",
    "multiple   spaces   between",
    "tab\tseparated\tvalues",
    "\t\tleading tabs",
    "line one\nline two\n",
    "\n\n\nnewlines first",
    "mixed \t \n whitespace \r\n runs",
    "windows\r\nline\r\nendings",
    "don't stop",
    "I'm sure they're fine, we'll see, you've won, he'd go",
    "DON'T SHOUT, IT'S LOUD",
    "numbers 1 12 123 1234 12345 1234567890",
    "3.14159 and 2.71828",
    "phone: +1-555-0100",
    "$1,000,000.00",
    "x=42; y = x**2 // 3",
    "def f(a, b):\n    return a + b\n",
    "  indented\n    code\n\tblock",
    "日本語の文章です。",
    "东京は大きな都市です",
    "中文字符测试，你好世界！",
    "한국어 텍스트",
    "Ünïcödé façade naïve café",
    "e\u0301 combining acute, a\u0308 combining umlaut",
    "Z\u0351\u0337a\u0338\u034al\u0362g\u0315o",
    "Привет, как дела?",
    "Ελληνικά γράμματα",
    "עברית וערבית العربية",
    "١٢٣ Arabic-Indic digits",
    "😀",
    "emoji 😀 in text 👍",
    "skin tone 👍🏽 modifier",
    "family 👨‍👩‍👧‍👦 ZWJ sequence",
    "flag 🇺🇸 and 🇯🇵",
    "heart ❤️ with variation selector",
    "🎉🎉🎉 repeated",
    "math ∑∫√∞ ≤ ≥ ≠",
    "arrows ← → ↑ ↓ and box ┌─┐",
    "quotes “curly” ‘single’ «guillemets»",
    "non\u00a0breaking\u00a0space",
    "zero\u200bwidth\u200bspace",
    "ideographic\u3000space",
    "<|begin_of_text|>",
    "<|begin_of_text|>Hello",
    "Hello<|eot_id|>",
    "text <|eot_id|> more text",
    "<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>",
    "<|eot_id|><|eot_id|>",
    "not special: <|eot_id| or <|unknown|>",
    "<|begin_of_text|> spaced <|end_of_text|> out ",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times.",
    "a" * 40,
    "abc" * 15,
    "    ",
    "\n",
    "end with newline\n\n",
    "MiXeD CaSe WoRdS",
    "snake_case_identifier and camelCaseIdentifier",
    "http://example.com/path?query=1&other=2",
    "email@example.com",
    "unreachable words like unreachable stay whole",
]


# Random strings over a pool of awkward pieces (fixed seed): differences
# between PCRE2 and Oniguruma in \s, \p{L}, \p{N} or lookaheads show up here.
RANDOM_POOL = [
    "a", "Z", "hello", "World", "é", "ß", "日本", "中", "한", "Ж", "ω", "ا", "́", "̈",
    "0", "7", "42", "1234", "٣", "½", "²", "Ⅻ", " ", "  ", "\t", "\n", "\r\n", "\r", "\x0b",
    "\x0c", "\u00a0", "\u3000", "\u2028", "\u0085", "\u200b", "'s", "'S", "'ll", "'", "’",
    "-", "_", ".", ",", "!?", "...", "(", ")", "<", ">", "|", "<|", "|>", "\"", "#", "$", "%",
    "😀", "👍🏽", "👨\u200d👩", "🇺🇸", "❤️", "\U0001F9D1\u200d\U0001F4BB", "\x00", "\x7f",
    "<|eot_id|>", "<|begin_of_text|>",
]


def random_cases(n, seed=1234):
    import random
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        k = rng.randint(1, 12)
        out.append("".join(rng.choice(RANDOM_POOL) for _ in range(k)))
    return out


def unicode_sweep(step=151, seed=99):
    """Every step-th code point assigned in this Python's Unicode version,
    shuffled, with spaces, letters, digits and newlines between. Python 3.11
    and Debian 12's PCRE2 10.42 both use Unicode 14; Hugging Face's
    Oniguruma tables are newer, so code points assigned after Unicode 14 are
    left out (PCRE2 sees them as unassigned and splits around them
    differently)."""
    import random
    import unicodedata
    rng = random.Random(seed)
    cps = [c for c in range(1, 0x32000, step)
           if not (0xD800 <= c <= 0xDFFF) and unicodedata.category(chr(c)) != "Cn"]
    rng.shuffle(cps)
    out = []
    for c in cps:
        out.append(chr(c))
        out.append(rng.choice(["", "", "", " ", "a", "1", " \n", "  "]))
    return "".join(out)


def training_text():
    texts = []
    for path in sorted(glob.glob("/usr/share/games/fortunes/*.u8"))[:12]:
        with open(path, encoding="utf-8", errors="ignore") as f:
            texts.append(f.read())
    if not texts:
        # Deterministic fallback corpus when the fortunes package is absent.
        texts = ["The quick brown fox jumps over the lazy dog. " * 200]
    return texts + EXTRA_TEXT


def train(pre_tokenizer, vocab_size, texts):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizer
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIALS)
    tok.train_from_iterator(texts, trainer)
    return tok


def make_gpt2_style(texts):
    tok = train(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), 900, texts)
    tok.add_tokens([AddedToken("<user-added>", special=False)])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    j = json.loads(tok.to_str())
    # Older tokenizer.json files store merges as "a b" strings.
    j["model"]["merges"] = [" ".join(m) if isinstance(m, list) else m for m in j["model"]["merges"]]
    return Tokenizer.from_str(json.dumps(j)), j


def make_llama3_style(texts):
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
    ])
    tok = train(pre, 1000, texts)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))]),
    ])
    j = json.loads(tok.to_str())
    j["model"]["ignore_merges"] = True
    # Whole words in the vocabulary that no merge sequence produces: only
    # ignore_merges finds them.
    vocab = j["model"]["vocab"]
    for word in ["Ġunreachable", "unreachable", "Ġwhole"]:
        if word not in vocab:
            vocab[word] = len(vocab)
    # Added tokens must keep ids past the model vocabulary.
    base = len(vocab)
    for t in j["added_tokens"]:
        if t["id"] >= base - 3:
            raise RuntimeError("added token ids collide with injected vocab")
    return Tokenizer.from_str(json.dumps(j)), j


def cases_for(tok):
    out = []
    for text in CASES + random_cases(150) + [unicode_sweep()]:
        plain = tok.encode(text, add_special_tokens=False).ids
        with_special = tok.encode(text, add_special_tokens=True).ids
        decoded = tok.decode(plain, skip_special_tokens=False)
        decoded_skip = tok.decode(plain, skip_special_tokens=True)
        case = {"text": text, "ids": plain, "ids_with_special": with_special}
        # Decoded strings are stored only where they differ (size): absent
        # "decoded" means the text itself, absent "decoded_skip_special"
        # means the same as "decoded".
        if decoded != text:
            case["decoded"] = decoded
        if decoded_skip != decoded:
            case["decoded_skip_special"] = decoded_skip
        out.append(case)
    return out


def fnv1a64(data):
    h = 0xcbf29ce484222325
    for b in data:
        h = ((h ^ b) * 0x100000001b3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def write_json(path, obj, indent=None):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, indent=indent)
        f.write("\n")


def make_tokenizers(out):
    texts = training_text()
    cases = {}
    for name, maker in [("gpt2_style", make_gpt2_style), ("llama3_style", make_llama3_style)]:
        tok, j = maker(texts)
        write_json(os.path.join(out, "tokenizers", name, "tokenizer.json"), j)
        # Reload from disk: the fixture is what the file says, not the object.
        tok = Tokenizer.from_file(os.path.join(out, "tokenizers", name, "tokenizer.json"))
        cases[name] = {"vocab_size": tok.get_vocab_size(with_added_tokens=True),
                       "cases": cases_for(tok)}
    bundled = os.path.join(os.path.dirname(__file__), "..", "models", "tandem-kjv", "tokenizer.json")
    if os.path.exists(bundled):
        tok = Tokenizer.from_file(bundled)
        with open(bundled, "rb") as f:
            digest = fnv1a64(f.read())
        # The C++ test compares this digest first: a retrained bundled
        # tokenizer needs this script rerun, and the test says so.
        cases["tandem-kjv"] = {"path": "models/tandem-kjv/tokenizer.json", "fnv1a64": digest,
                               "vocab_size": tok.get_vocab_size(with_added_tokens=True),
                               "cases": cases_for(tok)}
    write_json(os.path.join(out, "tokenizers", "cases.json"), cases)


# ---------------------------------------------------------------- models

BASE_CONFIG = {
    "vocab_size": 32,
    "hidden_size": 8,
    "intermediate_size": 12,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
}


def model_tensors(cfg, bias, tied, seed):
    g = torch.Generator().manual_seed(seed)
    h = cfg["hidden_size"]
    hd = cfg.get("head_dim", h // cfg["num_attention_heads"])
    q = cfg["num_attention_heads"] * hd
    kv = cfg["num_key_value_heads"] * hd
    inter = cfg["intermediate_size"]

    def r(*shape):
        return torch.randn(*shape, generator=g)

    t = {"model.embed_tokens.weight": r(cfg["vocab_size"], h), "model.norm.weight": 1 + 0.1 * r(h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + 0.1 * r(h)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * r(h)
        t[p + "self_attn.q_proj.weight"] = r(q, h)
        t[p + "self_attn.k_proj.weight"] = r(kv, h)
        t[p + "self_attn.v_proj.weight"] = r(kv, h)
        t[p + "self_attn.o_proj.weight"] = r(h, q)
        if bias:
            t[p + "self_attn.q_proj.bias"] = r(q)
            t[p + "self_attn.k_proj.bias"] = r(kv)
            t[p + "self_attn.v_proj.bias"] = r(kv)
        t[p + "mlp.gate_proj.weight"] = r(inter, h)
        t[p + "mlp.up_proj.weight"] = r(inter, h)
        t[p + "mlp.down_proj.weight"] = r(h, inter)
    if not tied:
        t["lm_head.weight"] = r(cfg["vocab_size"], h)
    return t


def expected_values(tensors):
    out = {}
    for name in sorted(tensors):
        v = tensors[name].float().flatten()
        out[name] = {"shape": list(tensors[name].shape), "sum": float(v.double().sum()),
                     "abs_sum": float(v.double().abs().sum()), "first": [float(x) for x in v[:4]],
                     "last": float(v[-1])}
    return out


def save_model(dirpath, config, gen_config, tensors, dtype, shards):
    os.makedirs(dirpath, exist_ok=True)
    write_json(os.path.join(dirpath, "config.json"), config, indent=2)
    if gen_config is not None:
        write_json(os.path.join(dirpath, "generation_config.json"), gen_config, indent=2)
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if shards == 1:
        save_file(tensors, os.path.join(dirpath, "model.safetensors"), metadata={"format": "pt"})
    else:
        names = sorted(tensors)
        weight_map = {}
        total = 0
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for i, n in enumerate(names) if i % shards == s}
            save_file(part, os.path.join(dirpath, fname), metadata={"format": "pt"})
            for n, v in part.items():
                weight_map[n] = fname
                total += v.numel() * v.element_size()
        write_json(os.path.join(dirpath, "model.safetensors.index.json"),
                   {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    write_json(os.path.join(dirpath, "expected.json"), expected_values(tensors), indent=1)


def make_models(out):
    # Llama, transformers-4 style, Llama-3 rope scaling, f32, one file.
    cfg = dict(BASE_CONFIG, architectures=["LlamaForCausalLM"], model_type="llama",
               torch_dtype="float32", tie_word_embeddings=False, attention_bias=False,
               rope_theta=500000.0,
               rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
               transformers_version="4.45.0")
    save_model(os.path.join(out, "models", "llama_f32"), cfg,
               {"bos_token_id": 1, "eos_token_id": [2, 3]},
               model_tensors(cfg, bias=False, tied=False, seed=1), torch.float32, 1)

    # Llama, transformers-5 style rope_parameters, bf16, 3 shards, explicit head_dim.
    cfg = dict(BASE_CONFIG, architectures=["LlamaForCausalLM"], model_type="llama",
               dtype="bfloat16", tie_word_embeddings=False, head_dim=6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
               transformers_version="5.0.0")
    save_model(os.path.join(out, "models", "llama_bf16_sharded"), cfg, None,
               model_tensors(cfg, bias=False, tied=False, seed=2), torch.bfloat16, 3)

    # Qwen2: q/k/v bias, tied embeddings, f16, one file.
    cfg = dict(BASE_CONFIG, architectures=["Qwen2ForCausalLM"], model_type="qwen2",
               torch_dtype="float16", tie_word_embeddings=True, rope_theta=1000000.0,
               use_sliding_window=False, transformers_version="4.45.0")
    save_model(os.path.join(out, "models", "qwen2_f16_tied"), cfg,
               {"bos_token_id": 1, "eos_token_id": 2},
               model_tensors(cfg, bias=True, tied=True, seed=3), torch.float16, 1)

    # Mistral, f16, two shards.
    cfg = dict(BASE_CONFIG, architectures=["MistralForCausalLM"], model_type="mistral",
               torch_dtype="float16", tie_word_embeddings=False, rope_theta=1000000.0,
               sliding_window=None, transformers_version="4.45.0")
    save_model(os.path.join(out, "models", "mistral_f16_sharded"), cfg, None,
               model_tensors(cfg, bias=False, tied=False, seed=4), torch.float16, 2)

    # Config-only variants.
    configs = {
        "llama_linear": dict(BASE_CONFIG, architectures=["LlamaForCausalLM"], rope_theta=10000.0,
                             rope_scaling={"type": "linear", "factor": 2.0}),
        "llama_tf5_llama3": dict(BASE_CONFIG, architectures=["LlamaForCausalLM"],
                                 rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                                  "factor": 32.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192}),
        "llama_no_kv_heads": {k: v for k, v in dict(BASE_CONFIG,
                              architectures=["LlamaForCausalLM"]).items()
                              if k != "num_key_value_heads"},
        "llama_yarn": dict(BASE_CONFIG, architectures=["LlamaForCausalLM"],
                           rope_scaling={"rope_type": "yarn", "factor": 4.0}),
    }
    for name, c in configs.items():
        write_json(os.path.join(out, "configs", name, "config.json"), c, indent=2)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests",
                                                  "fixtures", "model"))
    args = ap.parse_args()
    out = os.path.normpath(args.out)
    for sub in ["tokenizers", "models", "configs"]:
        shutil.rmtree(os.path.join(out, sub), ignore_errors=True)
    make_tokenizers(out)
    make_models(out)
    total = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, "**"), recursive=True)
                if os.path.isfile(p))
    print(f"wrote {out}: {total} bytes")


if __name__ == "__main__":
    main()
