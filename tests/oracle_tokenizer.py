# oracle_tokenizer.py: our tokenizer.json reader (common/data/tokenizer.c) against Hugging Face's
# `tokenizers` library, which shares no code with it.
#
#   python tests/oracle_tokenizer.py build/tests/tokenizer_ids WORKDIR
#
# The hub's Llama tokenizers cannot be downloaded here, so the library BUILDS tokenizer.json files
# of the forms Llama checkpoints ship, trained on the Alpaca fixtures (../shared/fixtures/alpaca):
#   llama2        Metaspace (prepend_scheme "first"), BPE with byte_fallback and the 256 "<0xNN>"
#                 tokens, <unk> <s> </s>; decoder Metaspace
#   llama2-legacy the same vocabulary the way Llama-2's own file has it: normalizer Prepend "▁" +
#                 Replace " " -> "▁", no pre-tokenizer, <s> etc. matched in the normalized text;
#                 decoder Replace, ByteFallback, Fuse, Strip
#   llama3        Split with Llama-3's pattern, then ByteLevel; BPE with ignore_merges;
#                 <|begin_of_text|> <|end_of_text|> <|eot_id|> ... as special tokens
#   gpt2-json     the fixture GPT-2 tokenizer.json alone (ByteLevel with GPT-2's pattern)
# Each encodes the test texts (without the post-processor's <s>: ours adds none either); ours must
# give the same ids, decode the library's ids to the library's text (specials kept), and decode
# its own ids back to the text. Prints "ok: ..." or "FAIL: ..." per check.
import glob, json, os, subprocess, sys

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
                  r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "shared", "fixtures")


def corpus():
    texts = []
    for path in sorted(glob.glob(os.path.join(FIXTURES, "alpaca", "*.json"))):
        for record in json.load(open(path, encoding="utf-8")):
            if isinstance(record, dict):
                texts.append("\n".join(str(record.get(k, "")) for k in ("instruction", "input", "output")))
    return texts


def test_texts(train):
    return [
        "Hello world", "a", "", " ", "\n\n\n", "  leading spaces", "trailing spaces   ",
        "runs   of    spaces\tand\t\ttabs", "tab\tbefore\tword and  two  spaces",
        "def f(x):\n    return x**2  # square\n\nfor i in range(10):\n\tprint(i)  \n",
        "if (a != b) { c[i] = d->e; }  // done!!\n",
        "line one\r\nline two\r\n\r\nend\r\n", "CR only\rhere\r\r",
        "I'm sure don't WE'LL they've She'S it'D o'Neil", "'s 't", "x's",
        "1234567 3.14159 10,000 2024-01-02 ½ ٣٤٥",
        "Café naïve façade — résumé, Ünïcödé ÀÉÎÕÜ", "日本語のテキストです。", "emoji 🚀🎉 done 👩‍👩‍👧",
        "control \x01\x02 del \x7f and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ﬁ", "nbsp\u00a0here ideographic\u3000space",
        "<s>Hello</s> <unk> x</s>y", "<|begin_of_text|>Hi<|eot_id|> <|start_header_id|>user<|end_header_id|>\n\n",
        "<|endoftext|>after", "a  <mask> b <mask>c\t\n<mask><|sep|>  \n x <|sep|>y", "((nested)) ...!!! ??\n\n\n next",
        "   \n  \n   x", "a\n\n  b", "tab\t\n\tx",
        "x'S'LL 'Ll 'Tis 'TWAS DON'Tknow O'REILLY 'Sam", "'ſ 'ſam", "e\u0301t\u0301e\u0301 \u0301x", "x²³⁴⁵ ١٢٣٤ Ⅻ", "a\u2028b\u0085c\u200bd\ufeffe\x1cf",
        ".\n\n\nx ;\r\n y", " !\n", "  !!", "\t(x)", "\n(x)", " 123 4567", "a1b22c333d4444",
    ] + train[:40]


def build_llama2(train, work):
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    trainer = trainers.BpeTrainer(vocab_size=3000, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(train, trainer)
    spec = json.loads(tok.to_str())
    # Llama-2's layout: <unk> <s> </s>, then the 256 byte tokens, then the trained pieces
    trained = [t for t, _ in sorted(spec["model"]["vocab"].items(), key=lambda kv: kv[1])]
    order = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    order += [t for t in trained if t not in order]
    spec["model"]["vocab"] = {t: i for i, t in enumerate(order)}
    for added in spec["added_tokens"]:
        added["id"] = order.index(added["content"])
    spec["post_processor"] = json.loads(processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 1)]).__getstate__())
    write(work, "llama2", spec)
    legacy = json.loads(json.dumps(spec))
    legacy["normalizer"] = json.loads(normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]).__getstate__())
    legacy["pre_tokenizer"] = None
    legacy["decoder"] = json.loads(decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)]).__getstate__())
    for added in legacy["added_tokens"]:  # as in Llama-2's file: matched after the normalizer
        added["normalized"] = True
    write(work, "llama2-legacy", legacy)


def build_llama3(train, work):
    # trained on whole texts, so that its tokens span the pattern's cuts ("'Tis", "x.\n"): a text
    # cut in other places than the pattern's encodes to other ids
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=6000, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(train, trainer)
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                            "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    # and two the way other files mark theirs: taking the whitespace before / after with them
    tok.add_tokens([AddedToken("<mask>", lstrip=True), AddedToken("<|sep|>", rstrip=True, special=True)])
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))])
    spec = json.loads(tok.to_str())
    write(work, "llama3", spec)
    # Llama-3-Instruct names its end of turn in tokenizer_config.json
    json.dump({"eos_token": "<|eot_id|>"}, open(os.path.join(work, "llama3", "tokenizer_config.json"), "w"))


def write(work, name, spec):
    os.makedirs(os.path.join(work, name), exist_ok=True)
    with open(os.path.join(work, name, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)


def check(ok, what):
    print(("ok: " if ok else "FAIL: ") + what)


def compare(name, program, work, texts, want_eot):
    path = os.path.join(work, name)
    lib = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    theirs = [lib.encode(t, add_special_tokens=False).ids for t in texts]
    with open(os.path.join(work, name + ".in.json"), "w") as f:
        json.dump({"texts": texts, "ids": theirs}, f)
    out = os.path.join(work, name + ".out.json")
    run = subprocess.run([program, path, os.path.join(work, name + ".in.json"), out], capture_output=True, text=True)
    if run.returncode != 0:
        check(False, f"{name}: tokenizer_ids failed: {run.stderr.strip()[-300:]}")
        return
    ours = json.load(open(out))
    check(ours["vocab_size"] == lib.get_vocab_size(with_added_tokens=True),
          f"{name}: vocabulary {ours['vocab_size']} (library {lib.get_vocab_size(with_added_tokens=True)})")
    check(ours["eot"] == lib.token_to_id(want_eot), f"{name}: end-of-text id {ours['eot']} is {want_eot}'s")
    bad_ids = [i for i, t in enumerate(texts) if ours["ids"][i] != theirs[i]]
    for i in bad_ids[:3]:
        print(f"  {name} {texts[i]!r}:\n    ours    {ours['ids'][i]}\n    library {theirs[i]}")
    check(not bad_ids, f"{name}: ids of {len(texts) - len(bad_ids)} of {len(texts)} texts equal the library's")
    bad_dec = [i for i, t in enumerate(texts)
               if bytes.fromhex(ours["decoded"][i]) != lib.decode(theirs[i], skip_special_tokens=False).encode()]
    for i in bad_dec[:3]:
        print(f"  {name} decode of {theirs[i]}: ours {bytes.fromhex(ours['decoded'][i])!r}, "
              f"library {lib.decode(theirs[i], skip_special_tokens=False)!r}")
    check(not bad_dec, f"{name}: decode of the library's ids equals the library's on {len(texts) - len(bad_dec)} of {len(texts)}")
    lossless = [i for i, t in enumerate(texts) if lib.decode(theirs[i], skip_special_tokens=False) == t]
    bad_back = [i for i in lossless if not ours["roundtrip"][i]]
    check(len(lossless) > len(texts) // 2 and not bad_back,
          f"{name}: our decode gives back the text of all {len(lossless)} texts the library's does"
          + (f" (not {texts[bad_back[0]]!r})" if bad_back else ""))


def main():
    program, work = sys.argv[1], sys.argv[2]
    # trained on the test texts too, so that their pieces are tokens (most non-ASCII characters
    # are not: those take byte fallback)
    train = corpus()
    texts = test_texts(train[::7])
    build_llama2(train + [t for t in texts if t.isascii()] * 3, work)
    build_llama3(train[:100] + [t for t in texts if t.isascii()] * 20, work)
    os.makedirs(os.path.join(work, "gpt2-json"), exist_ok=True)
    with open(os.path.join(FIXTURES, "lm-buddy-fake_gpt2", "tokenizer.json"), encoding="utf-8") as f:
        spec = json.load(f)
    write(work, "gpt2-json", spec)
    for name, eot in (("llama2", "</s>"), ("llama2-legacy", "</s>"), ("llama3", "<|eot_id|>"), ("gpt2-json", "<|endoftext|>")):
        compare(name, program, work, texts, eot)
    print("done: every tokenizer compared")


main()
