"""The external oracle of troupe's tokenizer support: Hugging Face's Python `tokenizers` (pinned in the
venv by scripts/provision-libtorch.sh). Prints one JSON line.

  train TEXT OUT.json VOCAB bytelevel   GPT-2's byte-level BPE trained on TEXT, <|endoftext|> special
  train TEXT OUT.json VOCAB metaspace   a SentencePiece-like BPE (NFKC, Metaspace "▁"), <unk> <s> </s>
  wordlevel OUT.json N                  a word-level tokenizer of the N words w0 .. w{N-1}, then </s>
  encode TOKENIZER FILE                 the ids of FILE's text (add_special_tokens=False)
  encode-jsonl TOKENIZER FILE           the ids of each line's "text", one list per line
  decode TOKENIZER 1,2,3                the text of the ids (skip_special_tokens=True)
"""

import json
import sys

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers


def train(text_path, out, vocab, kind):
    if kind == "bytelevel":
        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
    elif kind == "metaspace":
        tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
        tokenizer.normalizer = normalizers.NFKC()
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
        tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
        trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    else:
        raise SystemExit(f"unknown kind {kind}")
    tokenizer.train([text_path], trainer)
    tokenizer.save(out)
    return {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}


def wordlevel(out, n):
    vocab = {f"w{i}": i for i in range(n)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["</s>"])
    tokenizer.save(out)
    return {"vocab_size": tokenizer.get_vocab_size(with_added_tokens=True)}


def encode(tokenizer_path, path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    with open(path, encoding="utf-8", newline="") as f:
        text = f.read()
    return {"ids": tokenizer.encode(text, add_special_tokens=False).ids}


def encode_jsonl(tokenizer_path, path):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    with open(path, encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f if line.strip()]
    return {"ids": [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]}


def decode(tokenizer_path, ids):
    tokenizer = Tokenizer.from_file(tokenizer_path)
    return {"text": tokenizer.decode([int(i) for i in ids.split(",") if i], skip_special_tokens=True)}


def main():
    command, args = sys.argv[1], sys.argv[2:]
    if command == "train":
        result = train(args[0], args[1], int(args[2]), args[3])
    elif command == "wordlevel":
        result = wordlevel(args[0], int(args[1]))
    elif command == "encode":
        result = encode(args[0], args[1])
    elif command == "encode-jsonl":
        result = encode_jsonl(args[0], args[1])
    elif command == "decode":
        result = decode(args[0], args[1])
    else:
        raise SystemExit(f"unknown command {command}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
