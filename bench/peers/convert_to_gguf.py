#!/usr/bin/env python3
"""Converts a tandem model folder (Hugging Face layout) to an f32 GGUF with
llama.cpp's own converter, convert_hf_to_gguf.py, taken from LLAMA_DIR (the
llama.cpp source vendored in the llama-cpp-python sdist). Used by
bench/peers/run.sh; not part of CI.

The weights, tensor names and layout are the converter's own; two things
are adapted, in a staging folder, because the converter does not know this
project's tokenizer (the benchmark feeds random token ids, so neither
changes what is measured):
- tokenizer_config.json names "TokenizersBackend" (transformers 5); the
  converter's transformers 4.x loads the same tokenizer.json as
  "PreTrainedTokenizerFast";
- the converter identifies BPE pre-tokenizers by hashing a test string's
  tokens and refuses unknown ones; the bundled tokenizer uses the Llama-3
  split regex, so the pre-tokenizer is declared as "llama-bpe".
A model without a tokenizer (tools/make_random_model.py) gets the bundled
model's tokenizer files; the converter pads the vocabulary to the model's
vocab_size with unused tokens.

    convert_to_gguf.py LLAMA_DIR MODEL_DIR TOKENIZER_DIR OUT.gguf
"""
import json
import os
import shutil
import sys
import tempfile


def main() -> int:
    if len(sys.argv) != 5:
        print(__doc__, file=sys.stderr)
        return 2
    llama_dir, model_dir, tok_dir, out = sys.argv[1:]
    stage = tempfile.mkdtemp(prefix="gguf-stage-", dir=os.path.dirname(os.path.abspath(out)))
    try:
        for name in os.listdir(model_dir):
            if name.endswith((".safetensors", ".json")) and not name.startswith("tokenizer"):
                os.symlink(os.path.abspath(os.path.join(model_dir, name)), os.path.join(stage, name))
        shutil.copy(os.path.join(tok_dir, "tokenizer.json"), stage)
        with open(os.path.join(tok_dir, "tokenizer_config.json")) as f:
            tok_cfg = json.load(f)
        tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
        tok_cfg.pop("backend", None)
        with open(os.path.join(stage, "tokenizer_config.json"), "w") as f:
            json.dump(tok_cfg, f)

        sys.path.insert(0, os.path.join(llama_dir, "gguf-py"))
        sys.path.insert(0, llama_dir)
        import convert_hf_to_gguf  # noqa: E402  (llama.cpp's converter)
        from conversion import base  # noqa: E402

        base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "llama-bpe"
        sys.argv = ["convert_hf_to_gguf.py", stage, "--outtype", "f32", "--outfile", out]
        convert_hf_to_gguf.main()
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
