"""A tiny Hugging Face tokenizer built offline, for the training and SFT tests
(test_train_preflight.py, test_sft.py, test_sft_data_audit.py)."""

CHATML_SPECIALS = ("<|im_start|>", "<|im_end|>")
WORDS = "user assistant system What is the capital of France? Paris."


def tiny_bpe(template=None, specials=CHATML_SPECIALS, words=WORDS, bos=None, eos="<|im_end|>",
             pad=None, metaspace=False):
    """A transformers PreTrainedTokenizerFast: a byte-level BPE of 300 tokens trained on `words`,
    with `specials` as its special tokens and `template` as its chat_template; with `bos`,
    tok(text) puts it first (as Llama's). A token left None is not set (not saved as null).
    metaspace: a SentencePiece-style BPE instead (spaces as '▁', one put before the text, as
    Llama's and Mistral's tokenizer.json have it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    if metaspace:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
        tok.decoder = decoders.Metaspace(prepend_scheme="first")
        alphabet = sorted(set(words.replace(" ", "\u2581")) | {"\u2581"})
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=list(specials),
                                  initial_alphabet=alphabet)
    tok.train_from_iterator([words] * 4, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))])
    tokens = {k: v for k, v in (("bos_token", bos), ("eos_token", eos), ("pad_token", pad))
              if v is not None}
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, **tokens)
    fast.chat_template = template
    return fast
