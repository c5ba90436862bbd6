"""A model's generation_config.json sampling settings are the defaults of a request that sets
none, through deja.v1 and the VllmEngine door (vLLM's --generation-config auto); what a request
sets wins; --generation-config vllm keeps the neutral defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

from engine.sample.sampling_params import SamplingParams
from engine.worker.model_loader import sampling_defaults
from service.api.deja.v1 import inference_pb2 as pb
from service.replica import convert
from service.replica import vllm_convert as vc
from tests.service.conftest import StartServer, make_engine

DEFAULTS = {"temperature": 0.05, "top_p": 0.5, "top_k": 7, "repetition_penalty": 1.3}
PROMPT = list(range(100, 140))


@pytest.fixture(scope="module")
def tuned_model(tiny_llama_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with sampling settings in its generation_config.json."""
    out = tmp_path_factory.mktemp("tuned") / "model"
    shutil.copytree(tiny_llama_path, out)
    gen = out / "generation_config.json"
    gen.write_text(json.dumps({**json.loads(gen.read_text()), "do_sample": True, **DEFAULTS}))
    return out


def _fields(p: SamplingParams) -> dict[str, float]:
    return {k: getattr(p, k) for k in (*DEFAULTS, "min_p")}


def test_unset_fields_take_the_defaults_and_set_ones_win() -> None:
    unset = convert.sampling_params(pb.GenerateRequest(), DEFAULTS)
    assert _fields(unset) == {**DEFAULTS, "min_p": 0.0}
    req = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0, top_k=3, min_p=0.1))
    assert _fields(convert.sampling_params(req, DEFAULTS)) == {
        **DEFAULTS,
        "temperature": 0.0,  # set to greedy: stays greedy
        "top_k": 3,
        "min_p": 0.1,
    }
    assert _fields(convert.sampling_params(pb.GenerateRequest())) == {
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "min_p": 0.0,
    }
    vllm_unset = vc.sampling_params(vpb.SamplingParams(), DEFAULTS)
    assert _fields(vllm_unset) == {**DEFAULTS, "min_p": 0.0}
    vllm_set = vc.sampling_params(vpb.SamplingParams(temperature=0.0, top_p=0.75), DEFAULTS)
    assert (vllm_set.temperature, vllm_set.top_p, vllm_set.top_k) == (0.0, 0.75, 7)


def test_defaults_read_from_the_folder(tuned_model: Path, tiny_llama_path: Path) -> None:
    assert sampling_defaults(tuned_model) == DEFAULTS
    assert sampling_defaults(tiny_llama_path) == {}


async def _deja(h: Any, **sampling: Any) -> list[int]:
    res = await h.client.complete(PROMPT, max_tokens=16, seed=11, return_token_ids=True, **sampling)
    return list(res.choices[0].token_ids)


async def _vllm(h: Any, **sampling: Any) -> list[int]:
    async with grpc.aio.insecure_channel(h.target) as ch:
        req = vpb.GenerateRequest(
            request_id="r",
            tokenized=vpb.TokenizedInput(input_ids=PROMPT),
            sampling_params=vpb.SamplingParams(max_tokens=16, seed=11, **sampling),
        )
        out = [r async for r in vpb_grpc.VllmEngineStub(ch).Generate(req)]
    return list(out[-1].complete.output_ids)


@pytest.mark.parametrize("door", [_deja, _vllm], ids=["deja.v1", "VllmEngine"])
async def test_a_request_without_settings_samples_with_the_models(
    door: Any, tuned_model: Path, start_server: StartServer
) -> None:
    """Seeded: no settings gives exactly the tokens of the model's settings sent explicitly,
    and not those of the neutral defaults sent explicitly."""
    engine = make_engine(tuned_model)
    try:
        h = await start_server(engine)
        assert dict(engine.model_info.sampling_defaults) == DEFAULTS
        implicit = await door(h)
        explicit = await door(h, **DEFAULTS)
        neutral = await door(h, temperature=1.0, top_p=1.0, top_k=512, repetition_penalty=1.0)
        assert len(implicit) == 16
        assert implicit == explicit
        assert implicit != neutral
    finally:
        engine.shutdown()


def test_offline_generate_without_params_uses_the_models(tuned_model: Path) -> None:
    from engine import LLM

    llm = LLM(str(tuned_model), dtype="float32", num_device_blocks=64)
    assert _fields(llm.default_sampling_params()) == {**DEFAULTS, "min_p": 0.0}


def test_generation_config_vllm_keeps_neutral_defaults(tuned_model: Path) -> None:
    engine = make_engine(tuned_model, in_process=True, generation_config="vllm")
    try:
        assert engine.model_info.sampling_defaults == ()
    finally:
        engine.shutdown()
