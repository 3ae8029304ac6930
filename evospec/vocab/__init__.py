"""Draft vocabularies: the active set A the draft's LM head scores (full, static S, or S plus dynamic buffer D)."""
from evospec.vocab.active import ActiveVocab, full_vocab, static_vocab

__all__ = ["ActiveVocab", "full_vocab", "static_vocab"]
