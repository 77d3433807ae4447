"""CPU check: vLLM 0.26 vs transformers for use_audio_in_video (tiny checkpoints)."""
import os, sys, types
os.environ.setdefault("OMP_NUM_THREADS", "1")
import numpy as np, torch
torch.set_num_threads(1)
from transformers import AutoProcessor
from vllm.config import ModelConfig
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.multimodal.processing.inputs import ProcessorInputs
from vllm.multimodal.processing.context import TimingContext

which = sys.argv[1]  # q25 | q3
audio_s = float(sys.argv[2]) if len(sys.argv) > 2 else 4.3
nframes = int(sys.argv[3]) if len(sys.argv) > 3 else 8
path = {"q25": "var/models/tiny-qwen2_5-omni", "q3": "var/models/tiny-qwen3-omni-moe"}[which]
rng = np.random.default_rng(0)
frames = rng.integers(0, 255, (nframes, 64, 64, 3), dtype=np.uint8)
wave = (rng.standard_normal(int(16000 * audio_s)) * 0.1).astype(np.float32)

proc = AutoProcessor.from_pretrained(path)
msgs = [{"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "what is said?"}]}]
text = proc.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
print("template:", repr(text[-120:]))
hf = proc(text=text, audio=[wave], videos=[frames], use_audio_in_video=True, fps=2.0, return_tensors="pt")
hf_ids = hf["input_ids"][0].tolist()
print("hf keys", sorted(hf.keys()), "grid", hf["video_grid_thw"].tolist(), "spg", hf.get("video_second_per_grid"))

mc = ModelConfig(model=path, tokenizer=path, limit_mm_per_prompt={"audio": 1, "video": 1, "image": 0})
vp = MULTIMODAL_REGISTRY.create_processor(mc)
tok_ids = proc.tokenizer(text)["input_ids"]
res = {}
for label, kw in [("fps", {"use_audio_in_video": True, "fps": 2.0}),
                  ("fps+spg", {"use_audio_in_video": True, "fps": 2.0, "second_per_grid_ts": [1.0]})]:
    try:
        items = vp.info.parse_mm_data({"video": [frames], "audio": [(wave, 16000)]})
        out = vp.apply(ProcessorInputs(tok_ids, items, hf_processor_mm_kwargs=kw), TimingContext(enabled=False))
    except Exception as e:
        print(label, "vLLM apply failed:", type(e).__name__, str(e)[:300]); continue
    ids = out["prompt_token_ids"]
    print(label, "vllm ids == hf ids:", ids == hf_ids, len(ids), len(hf_ids))
    res[label] = out

# transformers positions
cfg = mc.hf_config
tcfg = cfg.thinker_config
if which == "q25":
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniPreTrainedModelForConditionalGeneration as HFB
    from vllm.model_executor.models.qwen2_5_omni_thinker import Qwen2_5OmniThinkerForConditionalGeneration as VM
else:
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoePreTrainedModelForConditionalGeneration as HFB
    from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeThinkerForConditionalGeneration as VM
class HF: pass
for n in ("get_rope_index", "get_llm_pos_ids_for_vision", "get_chunked_index"):
    if hasattr(HFB, n): setattr(HF, n, getattr(HFB, n))
h = HF(); h.config = tcfg; h.spatial_merge_size = tcfg.vision_config.spatial_merge_size
spg = hf.get("video_second_per_grid")
spg = torch.tensor(spg) if spg is not None and not torch.is_tensor(spg) else spg
hpos, _ = h.get_rope_index(hf["input_ids"], None, hf["video_grid_thw"], hf["attention_mask"], True,
                           hf["feature_attention_mask"].sum(-1), spg)
hpos = hpos[:, 0].long()
class VV: pass
for n in ("get_mrope_input_positions", "iter_mm_features", "_get_audio_for_video_mapping",
          "_compute_audio_token_count", "_compute_interleaved_positions"):
    setattr(VV, n, getattr(VM, n))
v = VV(); v.config = tcfg
import dataclasses
def feats(out, move):
    fs = []
    for mod, items in out["mm_kwargs"].items():
        for i, it in enumerate(items):
            pr = out["mm_placeholders"][mod][i]
            off = pr.offset
            if move and mod == "video" and out["prompt_token_ids"][off] == tcfg.audio_start_token_id \
                    and out["prompt_token_ids"][off - 1] == tcfg.vision_start_token_id:
                off -= 1
            fs.append(types.SimpleNamespace(modality=mod, data=it, mm_position=dataclasses.replace(pr, offset=off)))
    return fs
ids = hf_ids
def show(name, p):
    p = p.long()
    same = p.shape == hpos.shape and torch.equal(p, hpos)
    print(name, "== transformers:", same)
    if not same and p.shape == hpos.shape:
        d = (p != hpos).any(0).nonzero().flatten()
        print("   first diffs at", d[:6].tolist(), "of", len(d), "tokens", [ids[i] for i in d[:6].tolist()])
        k = int(d[0]); print("   hf", hpos[:, k-2:k+4].tolist()); print("   vl", p[:, k-2:k+4].tolist())
for label, out in res.items():
    for move in (False, True):
        try:
            p, _ = v.get_mrope_input_positions(out["prompt_token_ids"], feats(out, move))
            show(f"vLLM[{label}, moved={move}]", p)
        except Exception as e:
            print(label, move, "positions failed", type(e).__name__, e)
    print("placeholders", {m: [(r.offset, r.length) for r in rs] for m, rs in out["mm_placeholders"].items()},
          "ids at video offset", out["prompt_token_ids"][out["mm_placeholders"]["video"][0].offset - 1:][:3],
          "vision_start", tcfg.vision_start_token_id, "audio_start", tcfg.audio_start_token_id)
# talker reference positions (Qwen3: generate passes no use_audio_in_video to the talker)
if which == "q3":
    tp, _ = h.get_rope_index(hf["input_ids"], None, hf["video_grid_thw"], hf["attention_mask"], False,
                             hf["feature_attention_mask"].sum(-1), spg)
    print("q3 rope index with use_audio_in_video=False == True:", torch.equal(tp[:, 0].long(), hpos))
np.save(f"/tmp/notes/hf_pos_{which}.npy", hpos.numpy())
if which == "q3":
    t0 = tp[:, 0].long()
    print("q3 talker-mode (False) positions are plain arange:", torch.equal(t0, torch.arange(t0.shape[1]).expand(3, -1)))
