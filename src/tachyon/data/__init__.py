"""The embedded training corpus, its tokenizers and LM datasets for ``tachyon train``.

Nothing here downloads anything: the corpus (24 public-domain works of Shakespeare, ~3 MB,
see ``assets/SOURCE.md``) and the BPE tokenizer (``assets/tokenizer.json``, a Hugging Face
``tokenizers`` file) ship inside the package.

    from tachyon.data import build_lm_datasets, collate, load_tokenizer
    train, val = build_lm_datasets("masked", seq_len=128, seed=0, tokenizer="bpe")  # or "byte"
    vocab_size = train.tokenizer.vocab_size
    loader = DataLoader(train, batch_size=32, sampler=DistributedSampler(train), collate_fn=collate)
"""

from tachyon.data.corpus import load_corpus, load_works, split_document
from tachyon.data.datasets import (
    IGNORE_INDEX, VALIDATION_MASK_PROB, CausalLMDataset, MaskedLMDataset, build_lm_datasets, collate, sample_seed,
)
from tachyon.data.tokenizer import (
    BOS_ID, CLS_ID, EOS_ID, MASK_ID, NUM_SPECIAL_TOKENS, PAD_ID, SEP_ID, SPECIAL_TOKENS, TOKENIZER_NAMES, Tokenizer,
    load_tokenizer, padded_vocab_size, train_bpe,
)

__all__ = [
    "BOS_ID", "CLS_ID", "EOS_ID", "IGNORE_INDEX", "MASK_ID", "NUM_SPECIAL_TOKENS", "PAD_ID", "SEP_ID",
    "SPECIAL_TOKENS", "TOKENIZER_NAMES", "VALIDATION_MASK_PROB", "CausalLMDataset", "MaskedLMDataset", "Tokenizer",
    "build_lm_datasets", "collate", "load_corpus", "load_tokenizer", "load_works", "padded_vocab_size",
    "sample_seed", "split_document", "train_bpe",
]
