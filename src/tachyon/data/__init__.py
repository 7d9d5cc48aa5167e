"""The embedded training corpus, a byte-level tokenizer and LM datasets for ``tachyon train``.

Nothing here downloads anything: the corpus (24 public-domain works of Shakespeare, ~3 MB,
see ``assets/SOURCE.md``) and the BPE merges (``assets/bpe_1024.json``) ship inside the package.

    from tachyon.data import ByteTokenizer, build_lm_datasets, collate
    train, val = build_lm_datasets("masked", seq_len=128, seed=0, tokenizer="byte")  # or "bpe"
    vocab_size = train.tokenizer.vocab_size
    loader = DataLoader(train, batch_size=32, sampler=DistributedSampler(train), collate_fn=collate)
"""

from tachyon.data.bpe import BPETokenizer
from tachyon.data.corpus import load_corpus, load_works, split_document
from tachyon.data.datasets import (
    IGNORE_INDEX, CausalLMDataset, MaskedLMDataset, build_lm_datasets, collate, sample_seed,
)
from tachyon.data.tokenizer import (
    BOS_ID, CLS_ID, EOS_ID, MASK_ID, PAD_ID, SEP_ID, SPECIAL_TOKENS, VOCAB_SIZE, ByteTokenizer,
    get_tokenizer, padded_vocab_size,
)

__all__ = [
    "BOS_ID", "CLS_ID", "EOS_ID", "IGNORE_INDEX", "MASK_ID", "PAD_ID", "SEP_ID", "SPECIAL_TOKENS",
    "VOCAB_SIZE", "BPETokenizer", "ByteTokenizer", "CausalLMDataset", "MaskedLMDataset", "build_lm_datasets",
    "collate", "get_tokenizer", "load_corpus", "load_works", "padded_vocab_size", "sample_seed", "split_document",
]
