"""The embedded default model: special tokens pinned from the GGUF metadata, local-path resolution."""

from __future__ import annotations

import pytest

from data_tools.models import gguf_special_token_ids, pin_special_tokens, resolve_model, smollm2_gguf_path


def test_gguf_metadata_special_tokens():
    assert gguf_special_token_ids(smollm2_gguf_path()) == {"bos": 1, "eos": 2, "pad": 2, "unk": 0}


def test_pin_special_tokens_repairs_a_version_dependent_conversion():
    """transformers 5.17 converted SmolLM2's tokenizer with eos id 1 and no pad: pinning restores the file's ids."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model(None))
    tok.eos_token = "<|im_start|>"  # what the GPU machine's conversion produced
    tok.pad_token = None
    assert tok.eos_token_id == 1 and tok.pad_token_id is None
    pin_special_tokens(tok, smollm2_gguf_path())
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert (tok.pad_token_id, tok.bos_token_id, tok.unk_token_id) == (2, 1, 0)
    # the cached conversion used by every stage carries the same ids
    cached = AutoTokenizer.from_pretrained(resolve_model(None))
    assert (cached.eos_token_id, cached.pad_token_id, cached.bos_token_id) == (2, 2, 1)


def test_resolve_model_refuses_non_local_names(tmp_path):
    with pytest.raises(FileNotFoundError, match="no hub access"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(tmp_path / "empty")
    assert resolve_model(None) == resolve_model("smollm2-135m")
