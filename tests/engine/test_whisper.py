"""Whisper's arithmetic (engine/models/whisper.py) against transformers on a tiny random
`WhisperConfig` checkpoint saved with save_pretrained: the encoder states, each decoder layer's
cross-attention keys and values, the decoder's logits, and greedy tokens for several synthetic
audio inputs run together. (150 encoder positions instead of Whisper's 1500 keep it fast; the
shapes are otherwise Whisper's.) And `pagedserve kv-plan` for Whisper shapes: the self-attention
and cross-attention KV per request.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from pagedserve.engine.models.attention_metadata import AttentionMetadata
from pagedserve.engine.models.whisper import WhisperModel, cross_metadata, greedy
from pagedserve.engine.models.whisper_config import WhisperConfig, whisper_config_of
from pagedserve.engine.models.whisper_features import log_mel
from pagedserve.server.cli import main as cli_main
from tests.helpers import whisper_audio, whisper_features


def test_config_reads_the_checkpoints_fields(tiny_whisper):
    folder, _, ours = tiny_whisper
    c = ours.config
    assert (c.d_model, c.head_dim, c.num_frames, c.decoder_start_token_id, c.eos_token_id) == (
        64, 16, 300, 3, 2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="not a Whisper config \\(model_type 'llama'\\)"):
        WhisperConfig.from_hf_dict({"model_type": "llama"})
    d = json.loads((folder / "config.json").read_text())
    del d["num_mel_bins"]
    with pytest.raises(ValueError, match="Whisper config lacks num_mel_bins"):
        WhisperConfig.from_hf_dict(d)


@torch.inference_mode()
def test_encoder_and_cross_attention_kv_equal_transformers(tiny_whisper):
    _, hf, ours = tiny_whisper
    features = whisper_features(3)
    want = hf.model.encoder(features).last_hidden_state
    got = ours.encode(features)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for layer, (k, v) in zip(hf.model.decoder.layers, ours.cross_kv(got), strict=True):
        a = layer.encoder_attn
        torch.testing.assert_close(k, a.k_proj(want).view(3, 150, 4, 16).transpose(1, 2),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        torch.testing.assert_close(v, a.v_proj(want).view(3, 150, 4, 16).transpose(1, 2),
                                   rtol=1e-5, atol=1e-5)  # fmt: skip
        assert k.shape == (3, 4, 150, 16)


@torch.inference_mode()
def test_decoder_logits_equal_transformers(tiny_whisper):
    _, hf, ours = tiny_whisper
    features = whisper_features(2, seed=1)
    tokens = torch.tensor([[3, 17, 250, 9, 44], [3, 5, 5, 120, 299]])
    want = hf(input_features=features, decoder_input_ids=tokens).logits
    got = ours.decode(tokens, ours.cross_kv(ours.encode(features)))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@torch.inference_mode()
def test_greedy_tokens_equal_transformers_for_several_inputs_together(tiny_whisper):
    _, hf, ours = tiny_whisper
    features = whisper_features(3, seed=2)
    prompts = [[3], [3, 10], [3, 10, 11]]
    expected = []
    for i, prompt in enumerate(prompts):
        seq = list(prompt)
        for _ in range(12):
            logits = hf(input_features=features[i : i + 1], decoder_input_ids=torch.tensor([seq]))
            seq.append(int(logits.logits[0, -1].argmax()))
            if seq[-1] == 2:
                break
        expected.append(seq[len(prompt) :])
    got = greedy(ours, features, prompts, 12)
    assert got == expected
    assert len({tuple(t) for t in got}) == 3  # the inputs lead to different tokens


def test_bad_inputs_say_what_is_expected(tiny_whisper):
    _, hf, ours = tiny_whisper
    with pytest.raises(
        ValueError, match=r"features must be \[batch, 80, 300\] .* got \(1, 80, 299\)"
    ):
        ours.encode(torch.zeros(1, 80, 299))
    with pytest.raises(ValueError, match="decodes at most 64 tokens, got 65"):
        ours.decode(torch.zeros(1, 65, dtype=torch.long), [])
    fresh = WhisperModel(ours.config)
    parameters = len(hf.state_dict()) - 1  # all of transformers' but the tied proj_out
    assert parameters == 89
    with pytest.raises(ValueError, match=f"checkpoint is missing {parameters} tensors"):
        fresh.load_weights([])
    with pytest.raises(ValueError, match="'model.encoder.conv9.weight' has no place"):
        fresh.load_weights([("model.encoder.conv9.weight", torch.zeros(1))])


# ---- KV plan: self-attention and cross-attention groups ------------------------------------------


def test_whisper_models_are_recognised_by_shape_folder_or_config_file(tiny_whisper, tmp_path):
    folder, _, ours = tiny_whisper
    assert whisper_config_of("whisper-large-v3").d_model == 1280
    assert whisper_config_of(str(folder)) == ours.config
    assert whisper_config_of(str(folder / "config.json")) == ours.config
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert whisper_config_of(str(tmp_path)) is None
    assert whisper_config_of("smollm2-135m-instruct") is None
    assert whisper_config_of(str(tmp_path / "absent")) is None


def test_kv_plan_adds_the_cross_attention_blocks(capsys):
    # whisper-large-v3 in float16: 2 (K, V) x 32 decoder layers x 1280 x 2 bytes per token; its
    # cross-attention blocks hold 1500 such positions per request, written once.
    args = ["kv-plan", "--model", "whisper-large-v3", "--num-seqs", "16", "--dtype", "float16"]
    assert cli_main(args) == 0
    assert capsys.readouterr().out.splitlines() == [
        "model: whisper-large-v3 (whisper), 32 layers, 20 KV heads, head_dim 64, dtype float16 "
        "(2 bytes)",
        "per layer per token: 2 x 20 x 64 x 2 = 5120 bytes (K and V)",
        "per token: 32 layers x 5120 = 163840 bytes (160.0 KiB)",
        "total for 16 sequences x 448 tokens: M = 2*B*L*T*H_kv*D*s = 2*16*32*448*20*64*2 = "
        "1174405120 bytes (1.094 GiB)",
        "blocks: 28 per sequence of block_size 16, 448 in all (1174405120 bytes)",
        "cross-attention, per sequence (1500 encoder positions, written once): 1500 x 163840 = "
        "245760000 bytes (234.4 MiB), 94 blocks",
        "with cross-attention: 5106565120 bytes (4.756 GiB), 1952 blocks; cross-attention is "
        "77% of it",
    ]
    assert cli_main([*args, "--kv-cache-dtype", "fp8", "--max-model-len", "100"]) == 0
    out = capsys.readouterr().out
    assert "per token: 32 layers x 2560 = 81920 bytes (80.0 KiB)" in out
    assert "blocks: 7 per sequence of block_size 16, 112 in all" in out


# ---- the paged path the runner drives: self- and cross-attention blocks from one pool ----------

BLOCK = 16


def _paged_greedy(model, audio, prompts, max_new, ops) -> list[list[int]]:
    """Greedy decoding through `encode_into_cache` and `forward`, with the block bookkeeping a
    scheduler does: each request's cross-attention K/V written once into blocks of its own
    (ceil(150 / 16) = 10), its self-attention blocks from the same pool (and the same per-layer
    tensors); a first step with every prompt, then one token per unfinished request per step."""
    c = model.config
    model.ops = ops
    heads, hd, layers = c.decoder_attention_heads, c.head_dim, c.decoder_layers
    cross_blocks = -(-c.max_source_positions // BLOCK)
    self_blocks = -(-c.max_target_positions // BLOCK)
    n = len(prompts)
    shape = (n * (cross_blocks + self_blocks), BLOCK, heads, hd)
    # Unwritten slots hold a finite sentinel: read by mistake, it would change the tokens (the
    # reference's masked reads multiply them by 0, which NaN would not survive).
    caches = [(torch.full(shape, 7.5), torch.full(shape, 7.5)) for _ in range(layers)]
    # Requests take blocks from the end of the pool, interleaved, so tables are not 0, 1, 2 ...
    free = list(range(shape[0] - 1, -1, -1))
    cross_tables = [free[r::n][:cross_blocks] for r in range(n)]
    self_tables = [free[r::n][cross_blocks:] for r in range(n)]
    model.encode_into_cache([a.tobytes() for a in audio], [tuple(t) for t in cross_tables], caches,
                            BLOCK)  # fmt: skip

    seqs = [list(p) for p in prompts]
    new = [list(p) for p in prompts]  # tokens each request feeds this step
    outputs: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_new):
        live = [r for r in range(n) if new[r]]
        if not live:
            break
        tokens, token_pos, slots, owners, starts = [], [], [], [], [0]
        for r in live:
            first = len(seqs[r]) - len(new[r])
            for j, t in enumerate(new[r]):
                p = first + j
                tokens.append(t)
                token_pos.append(p)
                slots.append(self_tables[r][p // BLOCK] * BLOCK + p % BLOCK)
                owners.append(r)
            starts.append(starts[-1] + len(new[r]))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([slots]),
            block_tables=torch.tensor([[self_tables[r] for r in live]], dtype=torch.int32),
            seq_lens=torch.tensor([len(seqs[r]) for r in live], dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            cross=cross_metadata(np.array([cross_tables[r] for r in owners]),
                                 c.max_source_positions),
        )  # fmt: skip
        hidden = model(torch.tensor(tokens), torch.tensor(token_pos), caches, meta)
        logits = model.compute_logits(hidden)
        for i, r in enumerate(live):
            token = int(logits[starts[i + 1] - 1].argmax())
            outputs[r].append(token)
            seqs[r].append(token)
            new[r] = [] if token == c.eos_token_id else [token]
    return outputs


@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
@torch.inference_mode()
def test_paged_decoding_equals_the_reference_on_every_backend(tiny_whisper, backend):
    from pagedserve import kernels
    from pagedserve.kernels import cpu_ops

    if backend == "cpu" and not cpu_ops.available():
        pytest.skip("no C++ compiler here: the cpu backend is the reference")
    _, _, ours = tiny_whisper
    audio = whisper_audio(3, seed=2)
    prompts = [[3], [3, 10], [3, 10, 11, 12, 13]]
    expected = greedy(ours, log_mel(audio, 80, 300), prompts, 12)
    try:
        got = _paged_greedy(ours, audio, prompts, 12, kernels.get_backend(backend))
    finally:
        ours.ops = kernels.reference
    assert got == expected


def test_cross_metadata_gives_each_token_every_encoder_position():
    meta = cross_metadata(np.array([[5, 6], [7, 0], [5, 6]]), 20)
    assert meta.block_tables.tolist() == [[[5, 6], [7, 0], [5, 6]]]
    assert meta.seq_lens.tolist() == [20, 20, 20]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3]
