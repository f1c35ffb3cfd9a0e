// tokenizer.h: text <-> token ids.
//
// Two tokenizers behind one type:
//   * the byte tokenizer (the embedded default, needs no files): token id = byte value 0..255,
//     plus one end-of-text token, id 256. Vocabulary 257.
//   * GPT-2's byte-level BPE, read from a directory holding either OpenAI's files
//     (encoder.json + vocab.bpe) or Hugging Face's (vocab.json + merges.txt). Vocabulary 50257,
//     end-of-text "<|endoftext|>" = 50256. Added tokens (added_tokens.json, or tokenizer.json's
//     "added_tokens") follow the vocabulary: phi-1_5's CodeGen tokenizer adds runs of spaces and
//     tabs (50257..50294). As Hugging Face does, they are matched in the text before BPE
//     (leftmost, then longest), so "a  b" is [64, 50286, 65], not GPT-2's [64, 220, 275].
//
//   * Hugging Face's tokenizer.json, read from a directory that has it and none of GPT-2's files:
//     the forms Llama checkpoints ship. Llama-2's: Metaspace ("▁" for spaces, one prepended; or
//     the normalizer Prepend + Replace that older files use), BPE over characters with byte
//     fallback ("<0xNN>" tokens for characters not in the vocabulary). Llama-3's: Llama-3's split
//     pattern, then byte-level BPE. Added tokens (<s>, </s>, <|begin_of_text|>, <|eot_id|>, ...)
//     are matched in the text, as Hugging Face does; they decode to their text. End of text:
//     tokenizer_config.json's eos_token, else </s>, <|end_of_text|> or <|endoftext|>. Pipeline
//     parts it does not implement (other models, normalizers, pre-tokenizers, decoders, split
//     patterns) are refused by name. The post-processor is not applied: encode adds no <s>.
//
// All encode any byte string and decode back to the same bytes (tokenizer.json: unless its
// model has to drop or <unk> a character, or its decoder strips a leading space it did not add).
// As GPT-2's own encode() does, a literal "<|endoftext|>" inside the text is ordinary text for
// GPT-2's files (7 BPE tokens, not the end-of-text id): only the data loader adds end-of-text
// tokens.
#ifndef TOKENIZER_H
#define TOKENIZER_H

#include <stddef.h>

typedef struct Tokenizer Tokenizer;

// path NULL or "" -> the byte tokenizer; else a directory with encoder.json+vocab.bpe,
// vocab.json+merges.txt, or tokenizer.json. Errors (missing directory or file, malformed file) go through fatal()
// and name the path. The caller owns the result: tokenizer_free() it.
Tokenizer *tokenizer_load(const char *path);
void tokenizer_free(Tokenizer *t);

int tokenizer_vocab_size(const Tokenizer *t);  // 257, 50257, 128256 (whatever the files hold)
int tokenizer_eot(const Tokenizer *t);         // end-of-text id: 256, 50256, </s>'s...; -1 if none
int tokenizer_is_bpe(const Tokenizer *t);      // 0 for the byte tokenizer
const char *tokenizer_name(const Tokenizer *t);  // "byte" or the directory, for messages

// Encode len bytes of text (need not be NUL-terminated). Returns the number of ids; *ids gets a
// malloc'd array of that many ids (at least one byte allocated, so free(*ids) is always fine).
int tokenizer_encode(const Tokenizer *t, const char *text, size_t len, int **ids);

// Decode n ids into a malloc'd, NUL-terminated string (the caller frees it). An id outside
// 0..vocab-1 is a fatal() error.
char *tokenizer_decode(const Tokenizer *t, const int *ids, int n);

// The bytes of one token, for streaming output: returns a pointer into the tokenizer (valid until
// tokenizer_free, not NUL-terminated) and sets *len. A BPE token may hold only part of a UTF-8
// character (e.g. the first two bytes of an emoji): print the bytes as they come and the terminal
// puts the character together when the rest arrives.
const char *tokenizer_token_bytes(const Tokenizer *t, int id, int *len);

// 1 if the n bytes are valid UTF-8 (no overlong forms, no surrogates, nothing above U+10FFFF);
// else 0 and *bad_offset (if not NULL) gets the offset of the first bad byte.
int utf8_is_valid(const char *s, size_t n, size_t *bad_offset);

#endif
