#!/usr/bin/env python3
"""Checks that pipetransformer exports load in the Python ecosystem, and compute what we compute.

Usage: check_export.py DIR [DIR...]

For each DIR (a run's `model/` folder, or one written by tests/export_python.rs) it loads the
class that `config.json`'s `architectures` names with `transformers` and checks that every
tensor was used and none freshly initialised (BertModel may lack `pooler.*`: a mean-pooling
export has no pooler), that `id2label` came through, and that the tokenizer, image processor
and sentence-transformers modules present load.

If DIR holds `pipetransformer_check.json` (inputs and our outputs for them, written by
tests/export_python.rs) it also runs the inputs and compares, in float32 on the CPU:
  BERT  logits (BertForSequenceClassification, or classifier(pool(last_hidden_state)) by hand
        for a pooling no transformers class has), token ids of SentenceTransformer's tokenizer,
        and SentenceTransformer(DIR).encode (the pooled embedding);
  ViT   ViTImageProcessor's pixel_values from raw pixels, and ViTForImageClassification logits;
  GPT   token ids and decoding of the character tokenizer, and GPT2LMHeadModel logits.
Each comparison prints its max |difference|; one above the file's tolerance fails.

Needs torch, transformers and sentence-transformers (and pillow for the image processor), e.g.
    python3 -m venv /tmp/pyexp && /tmp/pyexp/bin/pip install torch transformers sentence-transformers pillow
Exit status: 0 all checks passed, 1 a check failed, 2 bad usage.
"""

import json
import os
import sys

import numpy as np
import torch
import transformers

CHECK_FILE = "pipetransformer_check.json"
DEFAULT_TOLERANCE = 1e-4


class CheckFailed(Exception):
    pass


def max_diff(ours, theirs):
    a = np.asarray(ours, dtype=np.float64)
    b = np.asarray(theirs, dtype=np.float64)
    if a.shape != b.shape:
        raise CheckFailed(f"shape {b.shape} from Python, ours is {a.shape}")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def compare(name, ours, theirs, tolerance):
    d = max_diff(ours, theirs)
    scale = float(np.max(np.abs(np.asarray(ours, dtype=np.float64))))
    print(f"  {name}: max |diff| {d:.3e} (tolerance {tolerance:g}; values up to {scale:.3g})")
    if not d <= tolerance:
        raise CheckFailed(f"{name} differs by {d:.3e} > {tolerance:g}")
    return d


def load_model(d, config):
    arch = (config.get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    if cls is None:
        raise CheckFailed(f"config.json names architecture {arch!r}, which transformers does not have")
    model, info = cls.from_pretrained(d, output_loading_info=True, attn_implementation="eager")
    model.eval()
    missing = list(info.get("missing_keys", []))
    unexpected = list(info.get("unexpected_keys", []))
    mismatched = list(info.get("mismatched_keys", []))
    if arch == "BertModel":
        # Mean/plain-[CLS] exports have no pooler; the classifier belongs to no BertModel part.
        missing = [k for k in missing if not k.startswith("pooler.")]
        unexpected = [k for k in unexpected if not k.startswith("classifier.")]
    if missing or unexpected or mismatched:
        raise CheckFailed(
            f"{arch}.from_pretrained: newly initialised {missing}, unused {unexpected}, mismatched {mismatched}"
        )
    print(f"  {arch}: every tensor loaded")
    id2label = config.get("id2label")
    if id2label:
        want = {int(k): v for k, v in id2label.items()}
        if dict(model.config.id2label) != want:
            raise CheckFailed(f"model.config.id2label is {model.config.id2label}, config.json has {want}")
        print(f"  id2label: {want}")
    return arch, model


def check_bert(d, arch, model, check, tol):
    ids = torch.tensor(check["input_ids"])
    mask = torch.tensor(check["attention_mask"])
    types = torch.tensor(check["token_type_ids"])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, token_type_ids=types)
    if arch == "BertForSequenceClassification":
        logits = out.logits
    else:
        # No transformers class classifies this pooling: apply the exported classifier by hand.
        from safetensors.torch import load_file

        head = load_file(os.path.join(d, "model.safetensors"))
        hidden = out.last_hidden_state
        if check["pooling"] == "mean":
            m = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * m).sum(1) / m.sum(1)
        else:
            pooled = hidden[:, 0]
        logits = pooled @ head["classifier.weight"].T + head["classifier.bias"]
    compare("logits", check["logits"], logits.numpy(), tol)

    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(d, device="cpu")
    # `preprocess` in sentence-transformers 6, `tokenize` before.
    features = (st.preprocess if hasattr(st, "preprocess") else st.tokenize)(check["sentences"])
    got_ids = features["input_ids"].tolist()
    if got_ids != check["input_ids"]:
        raise CheckFailed(f"SentenceTransformer tokenised to {got_ids}, we fed {check['input_ids']}")
    print("  SentenceTransformer tokens: identical")
    emb = st.encode(check["sentences"], batch_size=len(check["sentences"]), convert_to_numpy=True)
    compare(f"SentenceTransformer embeddings ({check['embedding']})", check["embeddings"], emb, tol)


def check_vit(d, model, check, tol):
    processor = transformers.ViTImageProcessor.from_pretrained(d)
    raw = np.asarray(check["raw_pixels"], dtype=np.uint8)  # [B, C, H, W]
    pixels = processor(images=list(raw), input_data_format="channels_first", return_tensors="pt")["pixel_values"]
    compare("ViTImageProcessor pixel_values", check["pixels"], pixels.numpy(), 1e-6)
    with torch.no_grad():
        logits = model(pixel_values=pixels).logits
    compare("logits", check["logits"], logits.numpy(), tol)


def check_gpt(d, model, check, tol):
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = [tok(t)["input_ids"] for t in check["texts"]]
    if ids != check["input_ids"]:
        raise CheckFailed(f"the tokenizer gives {ids}, we fed {check['input_ids']}")
    decoded = [tok.decode(i) for i in ids]
    if decoded != check["texts"]:
        raise CheckFailed(f"decoding gives {decoded!r}, expected {check['texts']!r}")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))
    if [fast(t)["input_ids"] for t in check["texts"]] != ids:
        raise CheckFailed("PreTrainedTokenizerFast(tokenizer_file=...) gives other ids than AutoTokenizer")
    print("  tokenizer (AutoTokenizer, PreTrainedTokenizerFast): same ids, decodes back")
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids)).logits
    compare("logits", check["logits"], logits.numpy(), tol)


def check_companions(d):
    """Loads what the export carries besides the model (with a check file, the checks use them)."""
    if os.path.isfile(os.path.join(d, "tokenizer.json")):
        transformers.AutoTokenizer.from_pretrained(d)
        print("  tokenizer: loads")
    if os.path.isfile(os.path.join(d, "preprocessor_config.json")):
        transformers.ViTImageProcessor.from_pretrained(d)
        print("  image processor: loads")
    if os.path.isfile(os.path.join(d, "modules.json")):
        from sentence_transformers import SentenceTransformer

        SentenceTransformer(d, device="cpu")
        print("  SentenceTransformer: loads")


def check_dir(d):
    print(f"{d}:")
    path = os.path.join(d, "config.json")
    if not os.path.isfile(path):
        raise CheckFailed(f"{path} is missing")
    with open(path) as f:
        config = json.load(f)
    arch, model = load_model(d, config)
    check_path = os.path.join(d, CHECK_FILE)
    if not os.path.isfile(check_path):
        check_companions(d)
        return
    with open(check_path) as f:
        check = json.load(f)
    tol = float(check.get("tolerance", DEFAULT_TOLERANCE))
    kind = check["kind"]
    if kind == "bert":
        check_bert(d, arch, model, check, tol)
    elif kind == "vit":
        check_vit(d, model, check, tol)
    elif kind == "gpt":
        check_gpt(d, model, check, tol)
    else:
        raise CheckFailed(f"{check_path}: unknown kind {kind!r}")


def main(argv):
    if len(argv) < 2 or argv[1] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    torch.manual_seed(0)
    torch.set_grad_enabled(False)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")
    failed = 0
    for d in argv[1:]:
        try:
            check_dir(d)
        except CheckFailed as e:
            print(f"  FAILED: {e}")
            failed += 1
        except Exception as e:  # a loader refusing the folder is a failed check, not a crash
            print(f"  FAILED: {type(e).__name__}: {e}")
            failed += 1
    print("all exports check out" if not failed else f"{failed} export(s) FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
