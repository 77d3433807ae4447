"""Pipeline config: the YAML a user writes, as pydantic models (the schema is the documentation)."""

from __future__ import annotations

import ipaddress
import ssl
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


def _check_zmq_address(a: str) -> str:
    """A ZMQ endpoint a stage binds or connects to: tcp://HOST:PORT or ipc://PATH."""
    host, _, port = a.removeprefix("tcp://").rpartition(":")
    if not (a.startswith("ipc://") and len(a) > 6 or a.startswith("tcp://") and host and port.isdigit()
            and 1 <= int(port) <= 65535):
        raise ValueError(f"a ZMQ address tcp://HOST:PORT (port 1-65535) or ipc://PATH, got {a!r}")
    if a.startswith("ipc://"):
        import zmq

        if len(a) - 6 > zmq.IPC_PATH_MAX_LEN:  # (else the bind fails only when the stage starts)
            raise ValueError(f"ipc path of {len(a) - 6} characters, at most {zmq.IPC_PATH_MAX_LEN}: {a!r}")
    return a


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SamplingDefaults(_Strict):
    """Per-stage defaults; for the client-facing text stage, request fields override them."""

    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    # Token ids never sampled (e.g. a talker's codec start token).
    suppress_token_ids: list[int] | None = None


class StageConfig(_Strict):
    id: int = Field(ge=0)
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_\-]+$")
    kind: Literal["ar", "generation"] = "ar"
    # Checkpoint directory (relative paths resolve against the config file's directory) or hub id.
    model: str
    tokenizer: str | None = None
    # Passed through to vllm.EngineArgs (AR stages) unchanged.
    engine_args: dict[str, Any] = {}
    # AR stages: one of our vLLM model classes by registered name (e.g. `qwen2_5_omni.talker`);
    # None = whatever vLLM serves for the checkpoint.
    model_class: str | None = None
    # Generation stages: the registered generator that runs (e.g. `qwen2_5_omni.token2wav`), and
    # how many ready requests it takes in one pass.
    generator: str | None = None
    max_batch_size: int = Field(8, ge=1)
    # Keyword arguments for the generator's constructor (e.g. token2wav's streaming window sizes).
    generator_args: dict[str, Any] = {}
    # The stage process's GPUs, e.g. "0" or "0,1": indices into the GPUs `serve` sees (its own
    # CUDA_VISIBLE_DEVICES, if set); None inherits them all.
    devices: str | None = None
    env: dict[str, str] = {}
    # Stage ids whose outputs feed this stage; empty = the client's prompt.
    inputs: list[Annotated[int, Field(ge=0)]] = []
    # Registered name that turns upstream payloads into this stage's engine input.
    input_processor: str | None = None
    # "full": upstream outputs arrive once the upstream request finished; "stream": in chunks of
    # `stream_chunk` positions while upstream still generates, and this stage starts as soon as its
    # input processor has enough (e.g. a talker on the thinker's first reply tokens).
    input_mode: Literal["full", "stream"] = "full"
    stream_chunk: int = Field(8, ge=1)
    # Backpressure on a streamed input: upstream runs at most this many output tokens ahead of what
    # this stage has used (it pauses that request meanwhile), so a slow stage never makes a fast one
    # buffer a whole reply for it. Any size works: a request of this stage that waits for input
    # always gets upstream's next chunk.
    stream_window: int = Field(256, ge=1)
    # What this stage returns to the client: "text" (detokenized message content),
    # "tokens" (token ids in the response's `omni_outputs`), "audio" (a generation stage's
    # waveform), or nothing.
    output: Literal["text", "tokens", "audio"] | None = None
    default_sampling: SamplingDefaults = SamplingDefaults()
    # AR stages: who draws tokens with top-k 1..1024 and a temperature (a talker's codec sampling).
    # "omni": omni-server's sampler (top-k before top-p, no sort of the vocabulary, the repetition
    # penalty from a seen-token mask on the device: less host work per step than vLLM's); "vllm":
    # vLLM's sampler; "auto": "omni" when `default_sampling.top_k` is set. Other requests: vLLM.
    sampler: Literal["auto", "omni", "vllm"] = "auto"
    # Engine processes behind this stage id; each request goes to the least-loaded ready one.
    replicas: int = Field(1, ge=1)
    # Per replica, CUDA_VISIBLE_DEVICES (overrides `devices`), e.g. ["0", "1"] for one GPU each.
    replica_devices: list[str] | None = None
    # The stage's input socket (one per replica: a list); None = ipc in the runtime dir. The stage binds it.
    address: str | list[str] | None = None
    startup_timeout_s: float = Field(600.0, gt=0)

    @field_validator("devices", mode="before")
    @classmethod
    def _devices_as_str(cls, v: Any) -> Any:
        # YAML reads `devices: 0` as an int and `devices: [0, 1]` as a list; both mean "0" / "0,1".
        if isinstance(v, int) and not isinstance(v, bool):
            return str(v)
        if isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in v):
            return ",".join(str(d) for d in v)
        return v

    @field_validator("address")
    @classmethod
    def _zmq_addresses(cls, v: str | list[str] | None) -> str | list[str] | None:
        for a in [v] if isinstance(v, str) else v or []:
            _check_zmq_address(a)
        return v

    @field_validator("devices", "replica_devices")
    @classmethod
    def _devices_are_gpus(cls, v: str | list[str] | None) -> str | list[str] | None:
        # What CUDA_VISIBLE_DEVICES takes: indices or GPU / MIG UUIDs, comma-separated.
        for d in [v] if isinstance(v, str) else v or []:
            if not all(p.strip().isdigit() or p.strip().startswith(("GPU-", "MIG-")) for p in d.split(",")):
                raise ValueError(f"GPU indices or UUIDs, one or comma-separated (e.g. 0 or 0,1), got {d!r}")
        return v

    @field_validator("replica_devices", mode="before")
    @classmethod
    def _replica_devices_as_str(cls, v: Any) -> Any:
        # [0, 1] or [[0, 1], [2, 3]] (one GPU / a TP group per replica) -> ["0", "1"] / ["0,1", "2,3"].
        if isinstance(v, list):
            return [cls._devices_as_str(d) for d in v]
        return v

    @field_validator("env", mode="before")
    @classmethod
    def _env_numbers_as_str(cls, v: Any) -> Any:
        # `OMP_NUM_THREADS: 4` is an int in YAML; environment values are strings.
        if isinstance(v, dict):
            return {
                k: str(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else x
                for k, x in v.items()
            }
        return v

    @model_validator(mode="after")
    def _inputs_need_processor(self) -> "StageConfig":
        if len(set(self.inputs)) != len(self.inputs):
            raise ValueError(f"`inputs` lists a stage more than once: {self.inputs}")
        if self.inputs and not self.input_processor:
            raise ValueError("a stage with `inputs` needs an `input_processor`")
        if not self.inputs and self.input_processor:
            raise ValueError("`input_processor` is set but the stage has no `inputs`")
        if self.input_mode == "stream" and not self.inputs:
            raise ValueError("`input_mode: stream` needs `inputs`")
        if self.kind == "generation":
            if not self.generator:
                raise ValueError("a `generation` stage needs a `generator`")
            if not self.inputs:
                raise ValueError("a `generation` stage needs `inputs` (it runs on upstream outputs)")
            if self.model_class or self.engine_args:
                raise ValueError("`model_class` / `engine_args` are for `ar` stages")
            if self.sampler == "omni":
                raise ValueError("`sampler` is for `ar` stages")
        elif self.generator or self.generator_args:
            raise ValueError("`generator` / `generator_args` are only for `kind: generation` stages")
        if self.output == "audio" and self.kind != "generation":
            raise ValueError("`output: audio` needs a `generation` stage")
        if isinstance(self.address, list) and len(self.address) != self.replicas:
            raise ValueError(f"`address` lists {len(self.address)} addresses for {self.replicas} replicas")
        if isinstance(self.address, str) and self.replicas > 1:
            raise ValueError("a stage with `replicas` needs one `address` per replica (a list)")
        if self.replica_devices is not None and len(self.replica_devices) != self.replicas:
            raise ValueError(f"`replica_devices` lists {len(self.replica_devices)} entries for "
                             f"{self.replicas} replicas")
        return self

    def address_of(self, replica: int) -> str | None:
        return self.address[replica] if isinstance(self.address, list) else self.address

    def devices_of(self, replica: int) -> str | None:
        return self.replica_devices[replica] if self.replica_devices is not None else self.devices

    @property
    def omni_sampler(self) -> bool:
        """Whether omni-server's sampler draws this AR stage's top-k requests (see `sampler`)."""
        if self.kind != "ar" or self.sampler == "vllm":
            return False
        return self.sampler == "omni" or bool(self.default_sampling.top_k)


class ServerConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # Bearer token for /v1/*; also read from OMNI_SERVER_API_KEY. None = open.
    api_key: str | None = None
    max_request_bytes: int = Field(16 << 20, ge=1024)
    max_prompt_tokens: int | None = Field(None, ge=1)
    # A Jinja chat template file (relative to the config file) used instead of the tokenizer's own,
    # e.g. one that writes `tools` into the prompt for a model whose template does not.
    chat_template: str | None = None
    max_tokens_limit: int = Field(4096, ge=1)
    # Each `input_audio` of a chat request: longer ones are answered 400.
    max_audio_seconds: float = Field(120.0, gt=0)
    # Each `image_url` image (width x height): larger ones are answered 400.
    max_image_pixels: int = Field(4096 * 4096, ge=1)
    # Each `video_url` video: frames kept (2 per second of video; longer ones are answered 400),
    # pixels per frame (max_image_pixels) and in all its frames (the api holds them: 3 bytes each;
    # the default is 128 frames of 1280 x 720, ~350 MB).
    max_video_frames: int = Field(128, ge=1)
    max_video_pixels: int = Field(128 * 1280 * 720, ge=1)
    # All of a request's media as decoded (the api holds them until the first stage has them):
    # beyond it 400. Small files decode large (a 50 KB PNG of one colour: 50 MB of pixels), and
    # without stage 0's limit_mm_per_prompt nothing else bounds how many parts a request has.
    max_media_bytes: int = Field(512 << 20, ge=1)
    # http(s) media URLs (image_url, video_url, audio_url parts): the hosts the api fetches from
    # (a domain covers its subdomains; "*": any host). None: only data: URLs are taken. Hosts that
    # resolve to non-public addresses (loopback, private, link-local) are refused unless
    # media_url_private (request forgery into the server's own network). Bodies up to
    # max_request_bytes, within media_url_timeout_s. https certificates are checked against the
    # public CAs (certifi's bundle) and, when media_url_ca_file names a PEM file, its CAs too (an
    # internal media store's own CA).
    media_url_domains: list[str] | None = None
    media_url_private: bool = False
    media_url_timeout_s: float = Field(10.0, gt=0)
    media_url_ca_file: str | None = None

    @field_validator("media_url_ca_file")
    @classmethod
    def _ca_file(cls, v: str | None) -> str | None:
        if v is not None:  # (a missing or unreadable file fails the config, not the first fetch)
            try:
                ssl.create_default_context().load_verify_locations(cafile=v)
            except (OSError, ssl.SSLError) as e:
                raise ValueError(f"cannot read CA certificates from {v!r}: {e}") from None
        return v

    @field_validator("media_url_domains")
    @classmethod
    def _domains(cls, v: list[str] | None) -> list[str] | None:
        if v is None:
            return None
        out = [d.strip().strip(".").strip("[]").lower() for d in v]
        for d in out:
            if not d or "/" in d or (":" in d and not _is_ip(d)):
                raise ValueError("must list host names or addresses (e.g. media.example.com), or \"*\" for any host")
        return out
    # /v1/audio/transcriptions asks the text stage for a transcript with one user turn: the audio,
    # then this instruction (`transcription_language_prompt` when the request names a language:
    # {language} becomes its name); after a system message when one is given (translations too).
    transcription_prompt: str = "Transcribe the audio into text."
    transcription_language_prompt: str = "Transcribe the {language} audio into text."
    transcription_system_prompt: str | None = None
    # /v1/audio/translations: the same turn with this instruction (OpenAI's translations are to English).
    translation_prompt: str = "Translate the speech in the audio into English text."

    @field_validator("transcription_language_prompt")
    @classmethod
    def _language_placeholder(cls, v: str) -> str:
        try:
            v.format(language="English")
        except (KeyError, IndexError, ValueError):
            raise ValueError("may hold {language} and no other {...} field (write {{ }} for a brace)") from None
        return v
    # Requests in flight beyond this are answered 429 with Retry-After (bounded memory under overload).
    max_concurrent_requests: int = Field(256, ge=1)
    # Pipeline requests one call may hold (a completion's prompts x n, a chat's n, a transcription's
    # clips): more is a 400, so that one client cannot take every slot above (64 prompts x n 4 did).
    max_requests_per_call: int = Field(32, ge=1)
    # A ready stage that answers nothing (not even the api's 1 s pings) this long is marked down.
    stage_timeout_s: float = Field(30.0, gt=0)
    # On SIGTERM: stop taking requests, let those in flight finish for up to this long, then stop.
    shutdown_timeout_s: float = Field(30.0, ge=0)
    # Where the api process binds its PULL socket for stage outputs; None = ipc in the runtime dir.
    output_address: str | None = None
    # Directory with the deployment's CURVE key (`omni-server keys DIR`): every socket between the
    # processes is encrypted and only holders of the key get messages accepted. For TCP across hosts.
    curve_keys_dir: str | None = None

    @field_validator("output_address")
    @classmethod
    def _zmq_address(cls, v: str | None) -> str | None:
        return v if v is None else _check_zmq_address(v)


class PipelineConfig(_Strict):
    # The model name clients pass in requests and /v1/models lists.
    model: str = Field(min_length=1)
    stages: list[StageConfig] = Field(min_length=1)
    server: ServerConfig = ServerConfig()
    # Directory for ipc sockets (relative: to the config file's directory); None = a fresh private
    # temp dir per `serve`.
    runtime_dir: str | None = None
    # CUDA MPS for the stage processes `serve` starts, when two of them share a GPU: their kernels
    # then run side by side instead of time-slicing it (orchestrator/mps.py). true: `serve` starts
    # its own MPS daemon or fails; "auto": it tries, and without one the stages time-slice.
    cuda_mps: bool | Literal["auto"] = False

    @model_validator(mode="after")
    def _check_graph(self) -> "PipelineConfig":
        ids = [s.id for s in self.stages]
        if ids != list(range(len(ids))):
            raise ValueError(f"stage ids must be 0..{len(ids) - 1} in order, got {ids}")
        names = [s.name for s in self.stages]
        dup = {n for n in names if names.count(n) > 1}
        if dup:
            raise ValueError(f"duplicate stage names: {sorted(dup)}")
        for s in self.stages:
            for src in s.inputs:
                if src == s.id:
                    raise ValueError(f"stage {s.id} ({s.name}): a stage cannot take its own output as input")
                if src >= s.id:
                    raise ValueError(
                        f"stage {s.id} ({s.name}): input {src} must be an earlier stage (the pipeline is a DAG in id order)"
                    )
        if not self.stages[0].inputs == []:
            raise ValueError("stage 0 must take the client's prompt (no `inputs`)")
        for kind in ("text", "audio"):
            outs = [s.id for s in self.stages if s.output == kind]
            if len(outs) > 1:
                raise ValueError(f"at most one stage can have `output: {kind}`, got stages {outs}")
        if not any(s.output for s in self.stages):
            raise ValueError("no stage has an `output` for the client")
        return self

    def stage(self, stage_id: int) -> StageConfig:
        return self.stages[stage_id]

    def units(self) -> list[tuple[int, int]]:
        """(stage id, replica) of every engine process."""
        return [(s.id, r) for s in self.stages for r in range(s.replicas)]

    def unit_name(self, unit: tuple[int, int]) -> str:
        stage_id, replica = unit
        s = self.stage(stage_id)
        return s.name if s.replicas == 1 else f"{s.name}#{replica}"

    def consumers(self, stage_id: int) -> list[int]:
        return [s.id for s in self.stages if stage_id in s.inputs]

    def output_stage(self, kind: str) -> StageConfig | None:
        return next((s for s in self.stages if s.output == kind), None)

    def route(self, outputs: set[str]) -> list[int]:
        """Ids of the stages a request needs for these output kinds: their stages and every
        stage upstream of them. Kinds this pipeline has no stage for are ignored."""
        need: set[int] = set()
        todo = [s.id for s in self.stages if s.output in outputs]
        while todo:
            i = todo.pop()
            if i not in need:
                need.add(i)
                todo.extend(self.stage(i).inputs)
        return sorted(need)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
        return True
    except ValueError:
        return False
