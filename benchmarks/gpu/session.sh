# The whole device session as one background job (start it with `setsid bash benchmarks/gpu/session.sh &`
# in the call that brings the last chunk; then `bash benchmarks/gpu/poll.sh` in each following call).
# Writes everything under /tmp/res (progress.log = one line per step, with seconds since start);
# poll.sh packs it into $OUT. On a two-GPU machine the second server starts on GPU 1 while the first
# is benched, and the two-GPU layouts (issue 8) run too.
# Steps run in the order STEPS names them (default "main warm prof t2wprof qwen3", ~900 s on
# one GPU; also: variants t2wtriton pastkv pastkvab prefix qkv ditvar t2wstep fp8 splits rate spy talkerlow talkerattn tests aa t2wboth t2wbig t2wlow attn full nomps mpspct thinkerlow qwen3eager qwen3mps qwen3prefix prefixprof t2wact talker t2w t2wfast runner mps
# prof ref w144 layouts fc24 fc72 tc4 media mmcompile video mnbt rt; MEDIA_KINDS="video text mixed" adds the mixed runs to video and mnbt).
set -u
# Run from a private copy: bash reads a script as it goes, and each device call copies the working
# tree again (a later edit of this file would change the running session under it).
if [ -z "${SESSION_REPO:-}" ]; then
  SESSION_REPO=$(cd "$(dirname "$0")/../.." && pwd) && cp "$0" /tmp/session.run.$$.sh && \
    SESSION_REPO=$SESSION_REPO exec bash /tmp/session.run.$$.sh "$@"
fi
R=/tmp/res
# A new session starts from an empty $R (a reused machine kept an earlier session's files, which
# collect.py would have read as this run's); more.sh's runs (MORE=1) add to it.
[ -n "${MORE:-}" ] || [ ! -d $R ] || mv $R $R.before.$(date +%s)
mkdir -p $R
# One session at a time (a second would share the GPU and the ports, and spoil both's numbers).
exec 9>/tmp/session.lock
flock -n 9 || { echo "another session.sh runs: not starting"; exit 1; }
# (poll.sh waits for this run's DONE, not an earlier one's)
[ ! -f $R/progress.log ] || sed -i "s/: DONE\$/: done (an earlier run)/" $R/progress.log
cd "$SESSION_REPO"
T0=$(date +%s)
say() { echo "$(( $(date +%s) - T0 )) s: $*" | tee -a $R/progress.log; }
# DRY=1: a CPU rehearsal of this script (no bundle; M and CFG point at the tiny checkpoint and config).
if [ -z "${DRY:-}" ] && ! source benchmarks/gpu/setup.sh > $R/setup.log 2>&1; then
  say "setup FAILED: $(tail -1 $R/setup.log)"; say "DONE"; exit 1
fi
set +e
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
NGPU=$(nvidia-smi -L 2>/dev/null | wc -l)
nvidia-smi > $R/nvidia-smi.txt 2>&1
say "setup done, $NGPU GPU(s)"
STEPS=${STEPS:-main warm prof t2wprof qwen3}
M=${M:-/tmp/omni7b}
CFG=${CFG:-configs/qwen2_5_omni.yaml}
TALKER_MAX=${TALKER_MAX:-500}
export MODEL=${MODEL:-qwen2.5-omni}
B="python3 -m omni_server.cli bench --model $MODEL --max-tokens 100 --audio"

# Text-only prompts in every step but `media`: the thinker serves text only (vLLM then skips its
# multimodal start-up profiling; the numbers compare with the runs before the shape checkpoint had
# the real media ids).
[ -n "${TEXT_ONLY+set}" ] || TEXT_ONLY='--stage-arg thinker.limit_mm_per_prompt={"image":0,"audio":0,"video":0}'
# serve NAME PORT CONFIG [--stage-arg ...]: start in the background, wait for /health ok (or 600 s).
# VOCODER / CKPT: the last stage's name and the checkpoint (the Qwen3 step sets them).
serve() {
  local name=$1 port=$2 cfg=$3 m=${CKPT:-$M}; shift 3
  setsid python3 -m omni_server.cli serve $cfg --port $port \
    --stage-arg thinker.model=$m --stage-arg talker.model=$m --stage-arg ${VOCODER:-token2wav}.model=$m \
    --stage-arg thinker.load_format=dummy --stage-arg talker.load_format=dummy \
    --stage-arg talker.default_sampling.max_tokens=$TALKER_MAX $TEXT_ONLY "$@" > $R/serve_$name.log 2>&1 9>&- &
  echo $! > $R/serve_$name.pid
}
wait_ready() {  # NAME PORT (READY_WAIT: seconds, default 600)
  local t=$(date +%s)
  for i in $(seq 1 ${READY_WAIT:-600}); do
    if curl -s localhost:$2/health | grep -q '"ok"'; then say "$1 ready after $(( $(date +%s) - t )) s"; return 0; fi
    if ! kill -0 $(cat $R/serve_$1.pid) 2>/dev/null; then break; fi
    sleep 1
  done
  say "$1 FAILED to start"; grep -a -i "error\|Traceback" $R/serve_$1.log | head -20 | tee -a $R/progress.log
  return 1
}
stop() {  # NAME (no-op unless it runs)
  local pid; pid=$(cat $R/serve_$1.pid 2>/dev/null) && kill -0 $pid 2>/dev/null || return 0
  kill -TERM -$pid 2>/dev/null; sleep 8; kill -KILL -$pid 2>/dev/null
}
free_gpus() { stop bench7b; stop bench7b_again; }  # the main server stays up for `ref` only
bench() {  # NAME PORT [MODEL]: warm-up, c=1 x3, c=16 x16
  local B="python3 -m omni_server.cli bench --model ${3:-$MODEL} --max-tokens 100 --audio"
  $B --base-url http://127.0.0.1:$2 --concurrency 1 --requests 1 --output $R/warm_$1.json > $R/bench_$1.log 2>&1
  $B --base-url http://127.0.0.1:$2 --concurrency 1 --requests 3 --output $R/$1_c1.json >> $R/bench_$1.log 2>&1
  $B --base-url http://127.0.0.1:$2 --concurrency 16 --requests 16 --output $R/$1_c16.json >> $R/bench_$1.log 2>&1
  say "$1 benched: $(python3 benchmarks/gpu/brief.py $R/$1_c1.json $R/$1_c16.json)"
}

bench_prefix() {  # NAME PORT [MODEL]: bench's warm-up, c=1 x3, c=16 x16, every chat opening on one
  # system message of PREFIX_WORDS words (default 1500); prints each stage's cached tokens at c=16
  local P="python3 -m omni_server.cli bench --model ${3:-$MODEL} --max-tokens 100 --audio"
  P="$P --base-url http://127.0.0.1:$2 --shared-prefix-words ${PREFIX_WORDS:-1500}"
  $P --concurrency 1 --requests 1 --output $R/warm_$1.json > $R/bench_$1.log 2>&1
  $P --concurrency 1 --requests 3 --output $R/$1_c1.json >> $R/bench_$1.log 2>&1
  $P --concurrency 16 --requests 16 --output $R/$1_c16.json >> $R/bench_$1.log 2>&1
  say "$1 (shared prefix) benched: $(python3 benchmarks/gpu/brief.py $R/$1_c1.json $R/$1_c16.json)"
  say "$1 cached tokens per stage at c=16: $(python3 -c "import json,sys; print([s.get('cached_tokens') for s in json.load(open(sys.argv[1]))['levels'][0]['stages']])" $R/$1_c16.json)"
}

served() {  # NAME PORT [serve arguments]: the 7B config ($CFG) with them, started, benched, stopped
  local name=$1 port=$2; shift 2
  serve $name $port $CFG "$@"
  wait_ready $name $port && bench $name $port
  stop $name
}

# (The steps that serve or read the 7B shape need it; ~20 s to write.)
NEED7B=
for s in $STEPS; do case $s in qwen3|qwen3eager|qwen3mps|qwen3cap|qwen3prefix|aa|tests) ;; *) NEED7B=1 ;; esac; done
if [ ! -f $M/config.json ] && [ -n "$NEED7B" ]; then
  python3 benchmarks/qwen2_5_omni_shape.py --out $M --size 7b --device cuda > $R/shape.log 2>&1
  say "7B shape checkpoint written (rc $?)"
fi

step_main() {
  # The streaming server on a cold compile cache (p6 cold), benched; it stays up for `ref`. After
  # another step's server the caches are warm: marked, so collect.py files its start apart.
  export VLLM_CACHE_ROOT=/tmp/vc
  if [ -n "$(ls -A /tmp/vc /tmp/torchinductor_$(id -un) 2>/dev/null)" ]; then
    ls -d /tmp/vc/* /tmp/torchinductor_$(id -un)/* 2>/dev/null | head -20 > $R/main_caches_warm.txt
  fi
  serve bench7b 8010 $CFG
  wait_ready bench7b 8010 || return
  nvidia-smi --query-gpu=index,memory.used,memory.total --format=csv >> $R/progress.log
  grep -a "CUDA graph" $R/serve_bench7b.log | head -3 | cut -c1-300 | tee -a $R/progress.log
  bench bench7b 8010
  # /v1/audio/speech on the same server: the text spoken (the talker still capped at TALKER_MAX codes).
  S="python3 -m omni_server.cli bench --model $MODEL --speech --prompt-words 40 --base-url http://127.0.0.1:8010"
  $S --concurrency 1 --requests 3 --output $R/speech7b_c1.json > $R/bench_speech7b.log 2>&1
  $S --concurrency 16 --requests 16 --output $R/speech7b_c16.json >> $R/bench_speech7b.log 2>&1
  say "speech benched: $(python3 benchmarks/gpu/brief.py $R/speech7b_c1.json $R/speech7b_c16.json)"
}

step_warm() {
  # The same config started again from `main`'s compile cache (p6 warm) and benched: a second sample
  # of the 7B numbers in the same run.
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  served bench7b_warm 8031
  say "warm start: $(grep -a 'graphs captured\|stages ready' $R/serve_bench7b_warm.log | cut -c1-220 | tr '\n' ' ')"
}

step_media() {
  # Media in: the 7B config with its thinker's media encoders on (the shape checkpoint's special
  # tokens carry the real ids), every chat carrying a MEDIA_AUDIO-second clip (default 5: voice
  # chat), then a MEDIA_IMAGE picture (default 1280x720), then text alone, on one server (warm cache
  # when `main` ran first): warm-up, c=1 x3, c=16 x16 each. MEDIA_KINDS: a subset of "audio image text".
  media_bench media7b 8041
}

step_mmcompile() {
  # The same with the thinker's vision and audio encoders compiled (vLLM's compile_mm_encoder; or
  # MMC_CONFIG, the thinker's compilation_config), filed as media_mmc_*: against `media`'s numbers
  # (run both, in either order).
  media_bench media7b_mmc 8042 --stage-arg "thinker.compilation_config=${MMC_CONFIG:-{\"compile_mm_encoder\": true\}}"
}

step_video() {
  # The 7B config taking one video a chat (the shipped configs' since the thirty-first run; the
  # start with vLLM's video profiling, and the numbers): each chat carrying a MEDIA_VIDEO video (default
  # 1280x720:10, 2 frames a second: 7,200 video tokens), then text alone, on one server (warm cache
  # when `main` ran first). The ready time and each GPU process's memory once ready go to progress.log.
  video_bench media7b_vid 8043
}

video_bench() {  # NAME PORT [serve args]: media_bench of the config taking one video a chat
  local name=$1 port=$2; shift 2
  MEDIA_KINDS=${MEDIA_KINDS:-video text} media_bench $name $port \
    --stage-arg 'thinker.limit_mm_per_prompt={"image":2,"audio":2,"video":1}' "$@"
}

step_mnbt() {
  # The `video` step with prefill chunks of MNBT tokens (default 2,048: the shipped configs' before
  # the thirty-first run, 2026-12-07; they take `vllm serve`'s 8,192 on these GPUs since) in the
  # thinker and talker; keys media_mnbt_*. Run beside `video` (the same server but for this).
  local n=${MNBT:-2048}
  video_bench media7b_mnbt 8045 \
    --stage-arg thinker.max_num_batched_tokens=$n --stage-arg talker.max_num_batched_tokens=$n
}

step_rt() {
  # Spoken replies over the Realtime API (`bench --realtime`: a WebSocket session a request, timed
  # from response.create), text alone and with a 5 s clip in the user item, against the same
  # prompts as chats on the same server (the 7B config; warm cache when `main` ran first). Realtime
  # answers end at the model's EOS (no ignore_eos there), at most 100 tokens.
  MEDIA_KINDS=${MEDIA_KINDS:-realtime rtaudio text} media_bench media7b_rt 8044
}

media_bench() {  # NAME PORT [serve args]
  local name=$1 port=$2 tag=${1#media7b}; shift 2
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  TEXT_ONLY="" serve $name $port $CFG "$@"
  wait_ready $name $port || return
  say "$name GPU memory once ready (MiB): $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
  local B="python3 -m omni_server.cli bench --model $MODEL --max-tokens 100 --audio --base-url http://127.0.0.1:$port"
  local kind n a
  for kind in "audio:--input-audio ${MEDIA_AUDIO:-5}" "image:--image ${MEDIA_IMAGE:-1280x720}" \
              "video:--video ${MEDIA_VIDEO:-1280x720:10}" "realtime:--realtime" \
              "rtaudio:--realtime --input-audio ${MEDIA_AUDIO:-5}" "text:"; do
    n=${kind%%:*}; a=${kind#*:}
    [[ " ${MEDIA_KINDS:-audio image text} " == *" $n "* ]] || continue
    $B $a --concurrency 1 --requests 1 --output $R/warm_media${tag}_$n.json >> $R/bench_$name.log 2>&1
    $B $a --concurrency 1 --requests 3 --output $R/media${tag}_${n}_c1.json >> $R/bench_$name.log 2>&1
    $B $a --concurrency 16 --requests 16 --output $R/media${tag}_${n}_c16.json >> $R/bench_$name.log 2>&1
    say "$name, $n in: $(python3 benchmarks/gpu/brief.py $R/media${tag}_${n}_c1.json $R/media${tag}_${n}_c16.json)"
  done
  # kind `mixed` (MEDIA_KINDS): 15 text chats under way when one video chat arrives (1 s later),
  # three times: what a long prefill costs the others' audio (their stalls), and the video's TTFP.
  if [[ " ${MEDIA_KINDS:-} " == *" mixed "* ]]; then
    local video="$B --video ${MEDIA_VIDEO:-1280x720:10} --concurrency 1 --requests 1"
    $video --output $R/warm_media${tag}_mix.json >> $R/bench_$name.log 2>&1
    for n in 1 2 3; do
      $B --concurrency 15 --requests 15 --output $R/media${tag}_mixtext_$n.json >> $R/bench_$name.log 2>&1 &
      local text=$!
      sleep 1
      $video --output $R/media${tag}_mixvideo_$n.json >> $R/bench_$name.log 2>&1
      wait $text  # (a bare wait would wait for the server too)
      say "$name, mixed $n: $(python3 benchmarks/gpu/brief.py $R/media${tag}_mixtext_$n.json $R/media${tag}_mixvideo_$n.json)"
    done
  fi
  stop $name
}

step_full() {
  # The same with token2wav in full-payload mode, from the first server's compile cache (p6 warm):
  # the TTFP ratio. (The config's fixed KV sizes let its engines build side by side; the `sized`
  # variant that measured that, 43.8 s on 2026-11-30d, is the config since.)
  # Also the thinker's and the talker's batch-1 steps under the torch profiler (in prof_c1/): 50 of
  # each within the bench's unmeasured warm-up request, where the talker steps without token2wav
  # beside it (3.5 ms per step, most of it host time: the c=1 RTF's limit).
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  local p="dir=$R/prof_c1,batch=1,steps=50,trace=1"
  serve bench7b_full 8011 $CFG --stage-arg token2wav.input_mode=full \
    --stage-arg thinker.env.OMNI_PROFILE=$p,skip=20 --stage-arg talker.env.OMNI_PROFILE=$p,skip=100
  wait_ready bench7b_full 8011 && bench bench7b_full 8011
  stop bench7b_full
  say "c=1 profiles: $(ls $R/prof_c1 2>/dev/null | tr '\n' ' ')"
}

step_ref() {
  # Issue 3: one text+audio chat through the openai client; then p4 (transformers' pipeline on the
  # same prompts, on the second GPU when there is one).
  curl -s localhost:8010/health | grep -q '"ok"' || { serve bench7b_again 8010 $CFG; wait_ready bench7b_again 8010 || return; }
  python3 - > $R/one_chat.txt 2>&1 <<'PY'
import os, time, openai
c = openai.OpenAI(base_url="http://127.0.0.1:8010/v1", api_key="x")
t = time.perf_counter()
r = c.chat.completions.create(model=os.environ.get("MODEL", "qwen2.5-omni"), messages=[{"role": "user", "content": "Hello, who are you?"}],
                              max_tokens=100, extra_body={"ignore_eos": True}, audio={"voice": "Chelsie", "format": "wav"},
                              modalities=["text", "audio"])
import base64, io, wave
w = wave.open(io.BytesIO(base64.b64decode(r.choices[0].message.audio.data)))
print("one text+audio chat:", round(time.perf_counter() - t, 3), "s;", r.usage.completion_tokens, "tokens;",
      "wav", w.getframerate(), "Hz", round(w.getnframes() / w.getframerate(), 2), "s")
PY
  say "$(tail -1 $R/one_chat.txt)"
  REFDEV=$(( NGPU - 1 )); [ -n "$TESTS_BG" ] && REFDEV=0  # GPU 1 runs the CUDA tests
  CUDA_VISIBLE_DEVICES=$REFDEV $B --base-url http://127.0.0.1:8010 --concurrency 16 --requests 16 --reference $M \
    --reference-talker-max-tokens $TALKER_MAX --reference-requests 2 --output $R/bench7b_c16_ref.json > $R/ref.log 2>&1
  say "reference done (rc $?): $(python3 -c "import json;d=json.load(open('$R/bench7b_c16_ref.json'));print(d.get('reference'), d['levels'][0].get('vs_reference'))" 2>&1 | tail -1)"
}

step_layouts() {
  free_gpus; wait_tests
  [ "$NGPU" -ge 2 ] || { say "layouts skipped: one GPU"; return; }
  # Issue 8: thinker on GPU 0, talker + token2wav on GPU 1; then a tensor-parallel thinker over both.
  serve gpu2 8012 configs/qwen2_5_omni_2gpu.yaml
  wait_ready gpu2 8012 && { nvidia-smi --query-gpu=index,memory.used --format=csv >> $R/progress.log; bench gpu2 8012; }
  stop gpu2
  # The TP=2 thinker (configs/qwen2_5_omni_tp2.yaml: plain NCCL all-reduce, no fused all-reduce +
  # RMSNorm, which picked FlashInfer's multicast backend and died in the first forward before).
  serve tp2 8013 configs/qwen2_5_omni_tp2.yaml
  wait_ready tp2 8013 && { nvidia-smi --query-gpu=index,memory.used --format=csv >> $R/progress.log; bench tp2 8013; }
  stop tp2
}

step_t2w() {
  # Token2wav alone on the 7B shape, batch 1 and 16: the configs' settings (graphs, TF32, bf16 DiT)
  # with and without the vocoder's polyphase upsampling and torch.compile (T2W_MODES: any of
  # token2wav_speed's modes; each compiled mode compiles at its first decode, tens of seconds).
  free_gpus
  # (2026-11-30g: whole-DiT compile 68 / 298 ms per window at batch 1 / 16, by blocks 74 / 317,
  # none 124 / 439.) Each mode in its own process, so start_s is its own compile: the DiT alone by
  # blocks first (cold), then DiT and vocoder (the DiT from Inductor's cache: the difference is the
  # vocoder's compile).
  : > $R/t2w.txt
  for mode in ${T2W_MODES:-graphs_bf16 graphs_bf16_compiled_dit_blocks graphs_bf16_compiled_blocks}; do
    timeout 400 python3 benchmarks/token2wav_speed.py --model $M --codes 300 --batch 1 16 --modes $mode >> $R/t2w.txt 2>&1
  done
  say "token2wav: $(grep RESULT $R/t2w.txt | python3 -c "import sys,json
for l in sys.stdin: d=json.loads(l[7:]); print(d['mode'], 'b', d['batch'], d['step_ms_p50'], 'ms/step rtf', d['rtf'], 'start', d.get('start_s'), 's', end='; ')")"
}

step_aa() {
  # One anti-aliased activation alone (benchmarks/antialias_speed.py): transformers' module against
  # our expression, eager and compiled, at channel counts of the 7B vocoder's stages. (Its compile
  # lands in Inductor's cache: a later server with the activations starts warmer.)
  free_gpus
  timeout 300 python3 benchmarks/antialias_speed.py --device cuda --batch 16 --channels 768 96 24 --length 2000 \
    > $R/aa.txt 2>&1
  # Inductor's code for it (how many kernels, what each reads and writes), one channel count.
  TORCH_LOGS=output_code timeout 200 python3 benchmarks/antialias_speed.py --device cuda --batch 16 --channels 96 \
    --length 2000 --repeats 1 > $R/aa_inductor.log 2>&1
  say "activation alone: $(grep RESULT $R/aa.txt | cut -c8- | tr '\n' ' '); kernels: $(grep -oE 'def triton_(poi|red|per)_[a-z_0-9]+' $R/aa_inductor.log | cut -c5- | sort -u | tr '\n' ' ')"
}

step_t2wprof() {
  # Token2wav alone with the 7B config's settings at batch 16 (c=16's token2wav-bound step) and 1
  # (c=1's windows): how a decode splits between the DiT's solves and the vocoder, and a profiler
  # table of its kernels (t2wprof/token2wav_<mode>_b<batch>.txt).
  free_gpus
  : > $R/t2wprof.txt
  timeout 300 python3 benchmarks/token2wav_speed.py --model $M --codes 300 --batch 1 16 --modes config_past_cache \
    --split --first-chunk-frames 48 48 72 96 --chunk-frames 144 --sdpa cudnn --profile $R/t2wprof >> $R/t2wprof.txt 2>&1
  say "token2wav split: $(grep RESULT $R/t2wprof.txt | cut -c8- | tr '\n' ' ')"
}

step_ditvar() {
  # The DiT body alone (one velocity evaluation, widest window, 7B shape): compiled by blocks as the
  # configs run it, then with Inductor's max-autotune (GEMM epilogues fused) and with FP8 projections
  # (benchmarks/dit_speed.py --variants; output error against the plain call). Rows 16 and 1.
  # DITVAR: the variants (one file per choice: ditvar_<variants>.txt, so `qkv` does not overwrite it).
  free_gpus
  local vars="${DITVAR:-autotune fp8}" out
  out=$R/ditvar_${vars// /_}.txt
  : > $out
  for rows in 16 1; do
    timeout 600 python3 benchmarks/dit_speed.py --model $M --device cuda --rows $rows --variants $vars >> $out 2>&1
  done
  say "dit variants: $(grep '^{' $out | tr '\n' ' ')"
}

t2w_alone() {  # MODE...: token2wav alone (benchmarks/token2wav_speed.py) with the 7B configs' windows,
  # batch 1 and 16, each mode in its own process (RESULT lines into t2w.txt: collect.py's keys
  # t2w_<mode>_b<batch>_step_ms, t2w_<mode>_start_s)
  local mode
  for mode in "$@"; do
    timeout 300 python3 benchmarks/token2wav_speed.py --model $M --codes 300 --batch 1 16 --modes $mode \
      --first-chunk-frames 48 48 72 96 --chunk-frames 144 --sdpa cudnn >> $R/t2w.txt 2>&1
  done
}

step_qkv() {
  # token2wav with one projection GEMM for the DiT attention's queries, keys and values
  # (`dit_fused_qkv`: at batch 1 the DiT is launch-bound, ~13 kernels a layer): the DiT body alone
  # (graph-replayed GPU ms, rows 32 and 2), token2wav alone against the configs' settings, then
  # served (keys `qkv_*`).
  free_gpus
  DITVAR=qkv step_ditvar
  t2w_alone config_step_graphs config_fused_qkv
  say "qkv alone: $(grep RESULT $R/t2w.txt | grep 'step_graphs\|fused_qkv' | cut -c8- | tr '\n' ' ')"
  export VLLM_CACHE_ROOT=/tmp/vc
  served qkv 8042 --stage-arg token2wav.generator_args.dit_fused_qkv=true
}

t2w_variant() {  # NAME PORT ARG MODE...: token2wav alone in each MODE (t2w_alone), then the 7B
  # config served with `--stage-arg ARG` (keys NAME_*)
  local name=$1 port=$2 arg=$3; shift 3
  free_gpus
  t2w_alone "$@"
  say "$name alone: $(grep RESULT $R/t2w.txt | tail -$(( 2 * $# )) | cut -c8- | tr '\n' ' ')"
  export VLLM_CACHE_ROOT=/tmp/vc
  served $name $port --stage-arg $arg
  say "$name: $(grep -a 'graphs captured\|capture failed\|stages ready' $R/serve_$name.log | cut -c1-220 | tr '\n' ' ')"
}

step_pastkv() {
  # token2wav keeping each stream's look-back keys and values between windows (`dit_past_cache`:
  # windows hold no past frames; 1,216 instead of 1,648 frame evaluations for 10 s of speech):
  # alone against the settings before (batch 1 and 16), then served (keys `pastkv_*`).
  t2w_variant pastkv 8044 token2wav.generator_args.dit_past_cache=true config_fused_qkv config_past_cache
}

step_t2wtriton() {
  # token2wav's vocoder activations as hand-written Triton kernels (`compile_vocoder: triton`; the
  # torch.compile'd ones were 355 of 1,666 ms of a batch-16 decode's GPU time, twenty-third run):
  # one activation alone at the vocoder's channel counts (antialias_speed.py), token2wav alone
  # against the configs' settings (batch 1 and 16) with its DiT / vocoder split and a profile of
  # each mode, also with the DiT's GELU in its GEMM's epilogue (`dit_gelu_epilogue`) and both,
  # then served with the Triton activations (keys `t2wtriton_*`).
  free_gpus
  timeout 200 python3 benchmarks/antialias_speed.py --device cuda --batch 16 --channels 768 384 96 24 \
    --length 4000 > $R/aa_triton.txt 2>&1
  say "t2wtriton activation alone: $(grep RESULT $R/aa_triton.txt | cut -c8-400 | tr '\n' ' ')"
  local mode
  for mode in config_triton_vocoder config_gelu_epilogue config_triton_gelu config_past_cache; do  # (each in its own process and time limit)
    timeout 300 python3 benchmarks/token2wav_speed.py --model $M --codes 300 --batch 1 16 --modes $mode --split \
      --first-chunk-frames 48 48 72 96 --chunk-frames 144 --sdpa cudnn --profile $R/t2wprof >> $R/t2wtriton.txt 2>&1
  done
  say "t2wtriton alone: $(grep RESULT $R/t2wtriton.txt | cut -c8-500 | tr '\n' ' ')"
  export VLLM_CACHE_ROOT=/tmp/vc
  served t2wtriton 8045 --stage-arg token2wav.generator_args.compile_vocoder=triton
}

step_pastkvab() {
  # `pastkv`'s A/B on one machine with the stages' steps logged: token2wav alone at batch 16 (each
  # window's step time: step_ms), then the 7B config served without and with dit_past_cache (keys
  # pkvoff_*, pkvon_*; steps by batch size in steps_pkvoff.txt / steps_pkvon.txt).
  free_gpus
  timeout 300 python3 benchmarks/token2wav_speed.py --model $M --codes 300 --batch 16 \
    --modes config_fused_qkv config_past_cache --first-chunk-frames 48 48 72 96 --chunk-frames 144 --sdpa cudnn \
    >> $R/t2w.txt 2>&1
  say "pastkvab alone: $(grep RESULT $R/t2w.txt | tail -2 | cut -c8-400 | tr '\n' ' ')"
  export VLLM_CACHE_ROOT=/tmp/vc
  local v sl
  for v in off on; do
    sl=$R/steps_pkv$v
    served pkv$v 8045 --stage-arg token2wav.env.OMNI_STEP_LOG=$sl --stage-arg talker.env.OMNI_STEP_LOG=$sl \
      --stage-arg token2wav.generator_args.dit_past_cache=$([ $v = on ] && echo true || echo false)
    python3 benchmarks/step_log.py $sl --bench $R/pkv${v}_c16.json --json $R/steps_pkv$v.json > $R/steps_pkv$v.txt 2>&1
    say "pkv$v steps: $(grep -A12 token2wav $R/steps_pkv$v.txt | tr -s ' ' | tr '\n' ';' | cut -c1-500)"
  done
}

step_smcap() {
  # The 7B config with the thinker and talker capped at P% of the SMs under MPS
  # (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE; the config's own cap since 2026-12-02 is 50, 100 = none), for
  # each P in SMCAP (default "100 50"; "T/K": the thinker at T%, the talker at K%, named smcapT_K; a
  # repeated P gets a suffix: "100 50 100 50" -> smcap100, smcap50, smcap100b, smcap50b): c=1 and
  # c=16 all at once, then 32 chats at 3/s, one server each, one after another on this machine
  # (keys smcap<P>_*, smcap<P>_rate_*).
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  local p name seen=" "
  for p in ${SMCAP:-100 50}; do
    name=smcap${p//\//_}
    while [[ "$seen" == *" $name "* ]]; do name=${name}b; done
    seen="$seen$name "
    serve $name 8044 $CFG --stage-arg thinker.env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${p%/*} \
      --stage-arg talker.env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${p#*/}
    if wait_ready $name 8044; then
      bench $name 8044
      $B --base-url http://127.0.0.1:8044 --concurrency 16 --requests 32 --request-rate 3 \
        --output $R/${name}_rate.json >> $R/bench_$name.log 2>&1
      say "$name rate 3/s: $(python3 benchmarks/gpu/brief.py $R/${name}_rate.json)"
    fi
    stop $name
  done
}

step_t2wstep() {
  # token2wav with one DiT graph per solver step (`dit_graph: step`, replayed 9 times a solve)
  # instead of per solve: each shape's warm-up is 2 steps of host work, not 10 (25 DiT graphs took 22.5-39.2 s of a
  # 49-83 s warm start on 2026-12-02). Alone (start and ms per step, batch 1 and 16, each mode in its
  # own process, the Inductor cache warm from `main`), then served (keys `t2wstep_*`).
  t2w_variant t2wstep 8038 token2wav.generator_args.dit_graph=step config config_step_graphs
}

step_prof() {
  # torch-profiler tables of each stage's steps at c=16 (OMNI_PROFILE, omni_server/stage/profiling.py):
  # the AR stages once 8 requests run (50 steps after 20), token2wav 4 steps after 2. In $R/prof.
  free_gpus
  local p="dir=$R/prof,batch=8"
  serve prof 8016 $CFG --stage-arg thinker.env.OMNI_PROFILE=$p,skip=20,steps=50 \
    --stage-arg talker.env.OMNI_PROFILE=$p,skip=20,steps=50 --stage-arg token2wav.env.OMNI_PROFILE=$p,skip=2,steps=4
  wait_ready prof 8016 && bench prof 8016
  stop prof
  say "profiles: $(ls $R/prof 2>/dev/null | tr '\n' ' ')"
}

step_prefixprof() {
  # Where the first outputs of 16 long-prompt chats at once wait (twentieth run: the thinker's came
  # ~500 ms after arrival with 95% of the prompt cached): `prefix`'s shared-prefix bench with
  # torch-profiler Chrome traces (trace=1) of the thinker's and talker's first 40 steps once 12
  # requests run (the c=16 burst's start). In $R/pprof (*.json: chrome://tracing or Perfetto).
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  local p="dir=$R/pprof,batch=${PPROF_BATCH:-12},skip=0,steps=40,trace=1"
  serve pprof 8052 $CFG --stage-arg thinker.env.OMNI_PROFILE=$p --stage-arg talker.env.OMNI_PROFILE=$p
  wait_ready pprof 8052 && bench_prefix pprof 8052
  stop pprof
  say "prefix profiles: $(ls $R/pprof 2>/dev/null | tr '\n' ' ')"
}

first_window() {  # FRAMES PORT [--stage-arg ...]: the one-GPU layout, token2wav's first window FRAMES mel frames
  free_gpus
  local frames=$1 port=$2; shift 2
  serve fc$frames $port $CFG --stage-arg token2wav.generator_args.first_chunk_frames=$frames "$@"
  wait_ready fc$frames $port && bench fc$frames $port
  stop fc$frames
}
# One first window instead of the configs' [48, 48] (then 72): 24 frames (earliest first packet,
# then a 72-frame window that cannot be ready before its 40 ms of playable audio has played: the
# bench's stalls) or 72 (the configs' value before 2026-11-30c).
step_fc24() { first_window 24 8019; }
step_fc72() { first_window 72 8017; }

W144=(--stage-arg 'token2wav.generator_args.first_chunk_frames=[48,48,72,96]'
      --stage-arg token2wav.generator_args.chunk_frames=144)
step_w144() {
  # Growing windows: 48, 48, 72, 96, then 144 new frames (the configs: 48, 48, then 72). A window
  # also computes 48 past + 24 future frames, so 72-frame windows pay 2x per new frame, 144-frame
  # ones 1.5x; c=16 is token2wav-bound (busy 0.89) and its DiT runs beside the talker at c=1.
  # benchmarks/window_schedule.py: no c=1 stall from the larger windows.
  free_gpus
  served w144 8022 "${W144[@]}"
}

step_t2wfast() {
  # (The 7B config's own settings since 2026-12-01, so now a variant for T2W_COMPILE / T2W_VOCODER.)
  # The 7B config with token2wav's opt-in speed-ups (polyphase upsampling, torch.compile of the
  # DiT's layers, block by block unless T2W_COMPILE=true, and the vocoder; both compile while its
  # graphs are captured at start): c=16 is token2wav-bound (busy 0.92 on 2026-11-30e). Its start
  # time says what the compile costs.
  free_gpus
  # (2026-11-30g, DiT by blocks and vocoder compiled: token2wav ready in 311 s cold, 65 s warm;
  # now the DiT only unless T2W_VOCODER=true.)
  serve t2wfast 8024 $CFG --stage-arg token2wav.generator_args.polyphase_upsampling=true \
    --stage-arg token2wav.generator_args.compile=${T2W_COMPILE:-blocks} \
    --stage-arg token2wav.generator_args.compile_vocoder=${T2W_VOCODER:-false}
  wait_ready t2wfast 8024 && bench t2wfast 8024
  stop t2wfast
  say "t2wfast: $(grep -a 'graphs captured\|capture failed' $R/serve_t2wfast.log | cut -c1-200 | tr '\n' ' ')"
  # (The 7B thinker's and talker's second start: their top-k/top-p warm-up should read 0.0 s from
  # the Triton cache pinned since 2026-11-30f; it took ~20 s at every second start before.)
  say "t2wfast warm-ups: $(grep -a 'warm-up: top-k' $R/serve_t2wfast.log | sed 's/.*warm-up: //' | cut -c1-60 | tr '\n' ' ')"
  # Started again: what the compile costs from Inductor's cache (TORCHINDUCTOR_CACHE_DIR; docker
  # keeps it in the ~/.cache volume).
  serve t2wfast_warm 8024 $CFG --stage-arg token2wav.generator_args.polyphase_upsampling=true \
    --stage-arg token2wav.generator_args.compile=${T2W_COMPILE:-blocks} \
    --stage-arg token2wav.generator_args.compile_vocoder=${T2W_VOCODER:-false}
  wait_ready t2wfast_warm 8024
  stop t2wfast_warm
  say "t2wfast warm: $(grep -a 'graphs captured\|all 3 stages ready' $R/serve_t2wfast_warm.log | cut -c1-200 | tr '\n' ' ')"
}

step_t2wact() {
  # The 7B config with the vocoder's anti-aliased activations compiled (compile_vocoder: activations;
  # opt-in until this runs): c=16 is token2wav-bound, and they were ~80% of its vocoder's time.
  free_gpus
  served t2wact 8027 --stage-arg token2wav.generator_args.compile_vocoder=activations
  say "t2wact: $(grep -a 'graphs captured\|capture failed' $R/serve_t2wact.log | cut -c1-200 | tr '\n' ' ')"
}

step_t2wboth() {
  # Both token2wav options measured on their own in the eleventh run: the vocoder's activations
  # compiled (c=16 RTF 0.650 -> 0.616) and growing windows up to 144 frames (0.650 -> 0.565).
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  served t2wboth 8029 --stage-arg token2wav.generator_args.compile_vocoder=activations "${W144[@]}"
  say "t2wboth: $(grep -a 'graphs captured\|capture failed\|stages ready' $R/serve_t2wboth.log | cut -c1-220 | tr '\n' ' ')"
}

step_t2wbig() {
  # t2wboth with windows growing one step further (48, 48, 72, 96, 144, then 216 new frames: 1.33x
  # per new frame instead of 1.5x): how far the c=16 RTF goes before first audio / stalls pay.
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  serve t2wbig 8030 $CFG --stage-arg token2wav.generator_args.compile_vocoder=activations \
    --stage-arg 'token2wav.generator_args.first_chunk_frames=[48,48,72,96,144]' \
    --stage-arg token2wav.generator_args.chunk_frames=216
  wait_ready t2wbig 8030 && bench t2wbig 8030
  stop t2wbig
  say "t2wbig: $(grep -a 'graphs captured\|capture failed\|stages ready' $R/serve_t2wbig.log | cut -c1-220 | tr '\n' ' ')"
}

step_attn() {
  # The 7B config with the DiT's attention pinned to one SDPA kernel (DIT_ATTN, default cudnn):
  # PyTorch picked cuDNN's in the tenth run (268 ms of a batch-16 decode) and the memory-efficient
  # one in the eleventh (356 ms), with the same code; token2wav alone with cuDNN's pinned: DiT
  # 1.779 -> 1.708 s of a batch-16 decode (2026-12-01, session 18's run).
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  served attn 8032 --stage-arg token2wav.generator_args.dit_attention=${DIT_ATTN:-cudnn}
  say "attn: $(grep -a 'graphs captured\|capture failed\|stages ready' $R/serve_attn.log | cut -c1-220 | tr '\n' ' ')"
}

step_mpspct() {
  # The 7B config under its MPS daemon with token2wav limited to MPS_PCT% of the SMs (default 50;
  # CUDA_MPS_ACTIVE_THREAD_PERCENTAGE in its environment): at c=16 the talker's step took 7.4 ms
  # beside token2wav against 2 ms alone (2026-12-01), and its first codes pace first audio.
  free_gpus
  served mpspct 8028 --stage-arg token2wav.env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${MPS_PCT:-50}
}

step_thinkerlow() {
  # The 7B config with the thinker at MPS's below-normal client priority: at c=1 first audio waits
  # for the talker's first 36 codes while the thinker still decodes beside it (the talker's stage
  # first output 54 ms, token2wav's 436 ms on 2026-12-01; 3.3 ms per talker step on average).
  free_gpus
  served thinkerlow 8030 --stage-arg thinker.env.CUDA_MPS_CLIENT_PRIORITY=1
}

step_t2wlow() {
  # The 7B config with token2wav at MPS's below-normal client priority: at c=16 the talker's batch
  # step took 6.7-7.0 ms beside token2wav (~2 ms alone), 3.4 of the ~4.6 s to the last packet
  # (2026-12-02 thirteenth run); token2wav has slack until each window's audio is due.
  free_gpus
  served t2wlow 8033 --stage-arg token2wav.env.CUDA_MPS_CLIENT_PRIORITY=1
}

step_spy() {
  # Where the stage processes' CPU time goes, at c=1 (4 s from 1 s into three requests in a row)
  # and in the c=16 burst (4 s from 1 s in): CPU seconds per thread of each stage process
  # (benchmarks/gpu/cpu_threads.py: a host-bound loop shows its thread near 1.0 of wall) and py-spy's
  # samples of their Python stacks (non-blocking, idle frames kept: waits show as such; summed by
  # benchmarks/gpu/spy_top.py). py-spy: a static binary in .gpu/extra (README).
  # SPY_PREFIX=N: every chat opens on one N-word system message (bench --shared-prefix-words), and
  # the c=16 samples start with the burst (where its first outputs wait).
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  serve spy 8035 $CFG
  wait_ready spy 8035 || return
  local B=$B
  [ -z "${SPY_PREFIX:-}" ] || B="$B --shared-prefix-words $SPY_PREFIX"
  mkdir -p $R/spy
  SPY_PIDS=""
  local s p
  for s in 0 1 2; do p=$(pgrep -f "omni_server.cli stage .*--stage $s " | head -1); SPY_PIDS="$SPY_PIDS $p"; done
  echo "stage pids (thinker talker token2wav):$SPY_PIDS" > $R/spy/pids.txt
  $B --base-url http://127.0.0.1:8035 --concurrency 1 --requests 1 --output $R/warm_spy.json > $R/bench_spy.log 2>&1
  spy_during 1 3 1 4
  spy_during 16 16 $([ -n "${SPY_PREFIX:-}" ] && echo 0 || echo 1) 4
  say "spy: $(python3 benchmarks/gpu/brief.py $R/spy_c1.json $R/spy_c16.json); $(grep -h 'pid' $R/spy/cpu_c*.txt | tr '\n' ' ')"
  stop spy
}
spy_during() {  # CONCURRENCY REQUESTS START_S DURATION_S (whole seconds: py-spy's)
  $B --base-url http://127.0.0.1:8035 --concurrency $1 --requests $2 --output $R/spy_c$1.json >> $R/bench_spy.log 2>&1 &
  local bench_pid=$! s=0 p
  sleep $3
  python3 benchmarks/gpu/cpu_threads.py snap $SPY_PIDS > $R/spy/a_c$1.json
  for p in $SPY_PIDS; do
    [ -x /tmp/py-spy ] && /tmp/py-spy record --nonblocking --idle -r 500 -d $4 -f raw -o $R/spy/c$1_stage$s.txt \
      -p $p > $R/spy/c$1_stage$s.log 2>&1 &
    s=$((s + 1))
  done
  sleep $4
  python3 benchmarks/gpu/cpu_threads.py snap $SPY_PIDS > $R/spy/b_c$1.json
  wait $bench_pid; sleep 2
  python3 benchmarks/gpu/cpu_threads.py diff $R/spy/a_c$1.json $R/spy/b_c$1.json > $R/spy/cpu_c$1.txt
}

step_talkerattn() {
  # The 7B config with the talker's attention in another vLLM backend (TALKER_ATTN, default
  # TRITON_ATTN): its c=1 step's GPU work is ~2.1 ms, 0.55 ms of it FlashAttention 3 at batch 1
  # (18.5 us + a 4.4 us split-KV combine per layer, 24 layers; 2026-12-02 fourteenth run).
  free_gpus
  served talkerattn 8037 --stage-arg talker.attention_backend=${TALKER_ATTN:-TRITON_ATTN}
}

step_fp8() {
  # The 7B config with the thinker (FP8_STAGES, default "thinker"; e.g. "thinker talker") quantized
  # to FP8 at load (vLLM's online `quantization: fp8`, weights per tensor, activations dynamic): at
  # c=1 first audio waits for 36 thinker steps (6.2-6.4 ms each beside the talker, bandwidth-bound),
  # so half the weight bytes should shorten them. Not the issue's bf16 numbers: a deployment option
  # (keys `fp8_*`).
  free_gpus
  local args="" st
  for st in ${FP8_STAGES:-thinker}; do args="$args --stage-arg $st.quantization=fp8"; done
  served fp8 8039 $args
}

step_splits() {
  # FlashAttention 3's decode in CUDA graphs may split the KV cache up to 32 ways (vLLM's
  # attention_config.flash_attn_max_num_splits_for_cuda_graph), then combine: at batch 1 with a few
  # hundred tokens of context that was 21 us + 4 us per layer of the thinker (0.59 ms of a ~5.6 ms
  # step) and 18.5 + 4.4 us of the talker (2026-12-02). With at most SPLITS (default 1): the
  # thinker's stage vs vLLM at batch 1 and 32 (keys as `runner`'s with `splits`: p5 with it), then
  # the 7B config served with it on the thinker and talker (keys `splits_*`).
  free_gpus
  local n=${SPLITS:-1} mode
  for mode in vllm omni; do
    timeout 400 python3 benchmarks/runner_overhead.py --model qwen2-7b --mode $mode --batch 1 32 --attention-splits $n \
      > $R/runner_splits_$mode.txt 2>&1
    say "runner $mode splits $n: $(grep RESULT $R/runner_splits_$mode.txt | tr '\n' ' ')"
  done
  served splits 8040 --stage-arg thinker.attention_config.flash_attn_max_num_splits_for_cuda_graph=$n \
    --stage-arg talker.attention_config.flash_attn_max_num_splits_for_cuda_graph=$n
}

step_prefix() {
  # Prefix caching beside the talker (omni_server/stage/prefix_rows.py), one server with it on (as
  # shipped: the thinker's rows kept beside its KV cache, the talker caching its projected rows),
  # one with the thinker's and the talker's caching off. Each is benched as `main` does (the bench's
  # prompts share the chat template's system prompt: keys pcon_*, pcoff_*), then with every chat
  # opening on one system message of PREFIX_WORDS words (default 1500: keys prefix_on_*, prefix_off_*).
  # PREFIX_MODES picks the servers (default "on off").
  # Then (unless PREFIX_RUNNER=0) runner_overhead.py with prefix caching on in both engines: the
  # served thinker's per-step cost of keeping the rows (keys pc_runner_vs_vllm_bs1/32, pc_hbm_fraction_bs1).
  free_gpus
  export VLLM_CACHE_ROOT=/tmp/vc
  local v port=8050 mode
  for v in ${PREFIX_MODES:-on off}; do
    port=$((port + 1))
    if [ $v = on ]; then serve prefix_$v $port $CFG; else serve prefix_$v $port $CFG \
      --stage-arg thinker.enable_prefix_caching=false --stage-arg talker.enable_prefix_caching=false; fi
    if wait_ready prefix_$v $port; then
      bench pc$v $port
      bench_prefix prefix_$v $port
      grep -a "KV cache size" $R/serve_prefix_$v.log | head -2 | cut -c1-200 | tee -a $R/progress.log
    fi
    stop prefix_$v
  done
  [ -z "${DRY:-}" ] || return 0  # (a CPU rehearsal: the runner benchmark is 7B-shaped)
  [ "${PREFIX_RUNNER:-1}" = 1 ] || return 0
  for mode in vllm omni; do
    timeout 400 python3 benchmarks/runner_overhead.py --model qwen2-7b --mode $mode --batch 1 32 --prefix-caching \
      > $R/runner_pc_$mode.txt 2>&1
    say "runner $mode prefix caching: $(grep RESULT $R/runner_pc_$mode.txt | tr '\n' ' ')"
  done
}

step_rate() {
  # The 7B config (warm cache) under spread-out arrivals: RATE requests a second (default 3; a list
  # runs each in turn on the one server), a Poisson schedule the same every run, at most 16 at once,
  # 32 requests. The c=16 bench starts
  # all at once, so token2wav's streams stay in step; here new streams' small first windows meet
  # others' 144-frame ones in one padded DiT pass (keys `rate_*`). (2026-12-02 sixteenth run: not
  # padding but all three stages on the GPU at once makes those passes dear.) RATE_ARGS: more serve
  # arguments, e.g. "--stage-arg thinker.quantization=fp8" or a stage's MPS priority. RATE_NAME: the
  # files' and server's name instead of "rate" (a second rate server on one machine; collect.py
  # reads "rate" only).
  free_gpus
  local n=${RATE_NAME:-rate}
  export VLLM_CACHE_ROOT=/tmp/vc
  # OMNI_STEP_LOG: every stage's steps (batch, ms) for benchmarks/step_log.py (steps_rate.txt).
  local sl=$R/steps_$n
  serve $n 8041 $CFG --stage-arg thinker.env.OMNI_STEP_LOG=$sl --stage-arg talker.env.OMNI_STEP_LOG=$sl \
    --stage-arg ${VOCODER:-token2wav}.env.OMNI_STEP_LOG=$sl ${RATE_ARGS:-}
  if wait_ready $n 8041; then
    $B --base-url http://127.0.0.1:8041 --concurrency 1 --requests 1 --output $R/warm_$n.json > $R/bench_$n.log 2>&1
    # RATE may list several (e.g. "3 2"): the first's file is rate_c16.json (keys rate_*), the others' rate_r<R>.json.
    local r out=
    for r in ${RATE:-3}; do
      out=${out:+$R/${n}_r$r.json}; out=${out:-$R/${n}_c16.json}
      $B --base-url http://127.0.0.1:8041 --concurrency 16 --requests 32 --request-rate $r \
        --output $out >> $R/bench_$n.log 2>&1
      say "$n $r/s: $(python3 benchmarks/gpu/brief.py $out)"
    done
    # RATE_ALL=1: then the usual all-at-once levels on this server (files ratesrv_c1/c16.json).
    [ -z "${RATE_ALL:-}" ] || bench ${n}srv 8041
  fi
  stop $n
  # (the steps during the first rate's level; keys rate_<stage>_steps, _mean_served, _step_ms_p50, _busy)
  python3 benchmarks/step_log.py $sl --bench $R/${n}_c16.json --json $R/steps_$n.json > $R/steps_$n.txt 2>&1
  say "$n steps: $(grep -A12 ${VOCODER:-token2wav} $R/steps_$n.txt | tr -s ' ' | tr '\n' ';' | cut -c1-600)"
}

step_variants() {
  # Serve-argument variants of the 7B config, one after another on this machine, each as step
  # `rate` (3/s, then c=1 and c=16 all at once) with its stages' steps logged. VARIANTS: entries
  # "NAME [serve arguments]" separated by ';' (no arguments: the config as it is), e.g.
  # VARIANTS="base; t2wlow --stage-arg token2wav.env.CUDA_MPS_CLIENT_PRIORITY=1; base2"
  # (keys v_NAME_*: the 3/s level's, v_NAMEsrv_* c=1 / c=16, v_NAMEsrv_<stage>_* the c=16 steps).
  local entries entry name args
  IFS=';' read -ra entries <<< "$VARIANTS"
  for entry in "${entries[@]}"; do
    read -r name args <<< "$entry"
    [ -n "$name" ] || continue
    RATE_NAME=v_$name RATE_ALL=1 RATE_ARGS="$args" step_rate
    python3 benchmarks/step_log.py $R/steps_v_$name --bench $R/v_${name}srv_c16.json \
      --json $R/steps_v_${name}srv.json > $R/steps_v_${name}srv.txt 2>&1
    say "v_$name c=16 steps: $(grep -A12 talker $R/steps_v_${name}srv.txt | tr -s ' ' | tr '\n' ';' | cut -c1-600)"
  done
}

step_talkerlow() {
  # The 7B config with the talker at MPS's below-normal client priority: at c=1 first audio waits
  # for 36 talker codes, each gated by a thinker step (6.2-6.4 ms beside the talker, 4.9 alone).
  free_gpus
  served talkerlow 8036 --stage-arg talker.env.CUDA_MPS_CLIENT_PRIORITY=1
}

step_nomps() {
  # The 7B config without its CUDA MPS daemon (`cuda_mps: false`: the stages time-slice the GPU):
  # what MPS gives (2026-12-01: c=16 first audio 1048 -> 897 ms, c=1 RTF 0.263 -> 0.208).
  free_gpus
  served nomps 8026 --cuda-mps false
}

step_tc4() {
  # The thinker streams to the talker every 4 positions at most instead of 8 (this matters with
  # many requests running: with one or two, rows go one per message anyway, ARStage.rows_chunk).
  free_gpus
  served tc4 8020 --stage-arg talker.stream_chunk=4
}

step_qwen3() {
  # Qwen3-Omni-30B-A3B shapes (benchmarks/qwen3_omni_shape.py: real sizes, dummy weights, the tiny
  # tokenizer's ids) in configs/qwen3_omni.yaml on one GPU, benched as the 7B; the talker capped
  # at 125 frames (10 s of audio at 12.5 Hz). (2026-11-30g: c=16 first audio 5.65 s.)
  free_gpus
  local m3=${M3:-/tmp/omni3}
  if [ ! -f $m3/config.json ]; then
    python3 benchmarks/qwen3_omni_shape.py --out $m3 > $R/shape3.log 2>&1
    say "Qwen3 shape checkpoint written (rc $?): $(tail -1 $R/shape3.log | cut -c1-200)"
  fi
  # (jit_monitor_verbose: vLLM logs each live kernel compile with its specialisation; 2026-12-01 one
  # fused-MoE kernel compiled during the c=16 burst, and the talker's first output came 1.15 s in.)
  # OMNI_PROFILE: tables of 30 talker steps inside the bench's unmeasured warm-up request (its steps
  # 31-61 of ~135 at 125 frames): where a frame goes. (Writing them holds the talker ~13 s: inside a measured c=1
  # request, as until 2026-12-01, that request paused 13.2 s.)
  local name=${1:-qwen3}; shift || true
  local frames=${QWEN3_FRAMES:-125}
  local skip=$(( frames / 4 )) steps=$(( frames / 3 < 30 ? frames / 3 : 30 ))
  CKPT=$m3 VOCODER=code2wav TALKER_MAX=${QWEN3_FRAMES:-125} serve $name 8021 ${CFG3:-configs/qwen3_omni.yaml} \
    --stage-arg thinker.jit_monitor_verbose=true --stage-arg talker.jit_monitor_verbose=true \
    --stage-arg talker.env.OMNI_PROFILE=dir=$R/prof_$name,batch=1,skip=$skip,steps=$steps "$@"
  wait_ready $name 8021 && { nvidia-smi --query-gpu=index,memory.used --format=csv >> $R/progress.log
                             bench $name 8021 ${MODEL3:-qwen3-omni}
                             [ -z "${QWEN3_PREFIX:-}" ] || bench_prefix ${name}_prefix 8021 ${MODEL3:-qwen3-omni}; }
  stop $name
  say "$name warm-up: $(grep -a 'warm-up:' $R/serve_$name.log | cut -c1-240 | tr '\n' ' ')"
  say "$name slow loop turns: $(grep -ac 'between engine steps' $R/serve_$name.log), kernels compiled while serving: $(grep -ac 'JIT compilation during inference' $R/serve_$name.log)"
  grep -a 'JIT compilation during inference' $R/serve_$name.log | cut -c1-600 | head -4 >> $R/progress.log
}
# The same without the code predictor's compile (the Qwen3 config's since the eleventh run: c=1 talker
# step 27.0 -> 13.1 ms). Keys qwen3eager_*.
# Qwen3 with and without its thinker's prefix caching, each also benched with a shared PREFIX_WORDS
# system message (keys qwen3pcon_*, qwen3pcoff_*, qwen3pcon_prefix_*, qwen3pcoff_prefix_*).
# QWEN3_PC: which of the two (default "on off").
step_qwen3prefix() {
  local v
  for v in ${QWEN3_PC:-on off}; do
    if [ $v = on ]; then QWEN3_PREFIX=1 step_qwen3 qwen3pcon
    else QWEN3_PREFIX=1 step_qwen3 qwen3pcoff --stage-arg thinker.enable_prefix_caching=false; fi
  done
}
step_qwen3eager() { step_qwen3 qwen3eager --stage-arg talker.additional_config.code_predictor.compile=false; }
# The same with its thinker and talker capped at QWEN3_CAP% of the SMs under MPS (default 50: the 7B
# config's cap, eighteenth run; the Qwen3 config has none yet). Keys qwen3cap_*.
step_qwen3cap() {
  step_qwen3 qwen3cap --stage-arg thinker.env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${QWEN3_CAP:-50} \
    --stage-arg talker.env.CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=${QWEN3_CAP:-50}
}
# Qwen3 under serve's own CUDA MPS daemon (keys qwen3mps_*; the Qwen3 config's own since the tenth
# run, so now the same as `qwen3`).
step_qwen3mps() { step_qwen3 qwen3mps --cuda-mps auto; }

step_mps() {
  # The one-GPU layout under CUDA MPS (stage processes' kernels run side by side instead of
  # time-slicing the GPU), if the host has the daemon.
  free_gpus
  command -v nvidia-cuda-mps-control > /dev/null || { say "mps skipped: no nvidia-cuda-mps-control"; return; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  CUDA_VISIBLE_DEVICES=0 nvidia-cuda-mps-control -d && say "MPS daemon up"
  serve mps 8015 $CFG && wait_ready mps 8015 && bench mps 8015
  stop mps
  # MPS_PRIO=1: the same with token2wav's kernels at MPS's below-normal client priority (on
  # 2026-11-30e no better than plain MPS: c=16 TTFP 1068 vs 1023 ms).
  if [ -n "${MPS_PRIO:-}" ]; then
    serve mpsprio 8023 $CFG --stage-arg token2wav.env.CUDA_MPS_CLIENT_PRIORITY=1
    wait_ready mpsprio 8023 && bench mpsprio 8023
    stop mpsprio
  fi
  # MPS_FAST=1: under MPS with t2wfast's token2wav (run `t2wfast` first: its compile cache). MPS
  # and compile each brought c=16 first audio near p2's 1000 ms goal (1023 and 1037 ms).
  if [ -n "${MPS_FAST:-}" ]; then
    serve mpsfast 8025 $CFG --stage-arg token2wav.generator_args.polyphase_upsampling=true \
      --stage-arg token2wav.generator_args.compile=${T2W_COMPILE:-blocks} \
      --stage-arg token2wav.generator_args.compile_vocoder=${T2W_VOCODER:-false}
    wait_ready mpsfast 8025 && bench mpsfast 8025
    stop mpsfast
  fi
  echo quit | nvidia-cuda-mps-control
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}

step_tests() {
  [ -n "${CUDA_VISIBLE_DEVICES:-}" ] || free_gpus  # (in the background on GPU 1: nothing to free)
  mkdir -p $R/testlogs
  # TESTS: other pytest arguments, split on spaces (e.g. tests/test_token2wav.py -k graph).
  TESTS=${TESTS:-tests/test_transfer.py tests/test_sampler_warmup.py tests/test_token2wav.py tests/test_e2e_speech.py \
    tests/test_e2e_two_stage.py tests/test_e2e_qwen3_omni.py tests/test_qwen3_thinker_tap.py tests/test_code_predictor_qwen3.py tests/test_stage_stream.py tests/test_sampling.py}
  # SIGINT at the limit: pytest still prints its summary and durations. Few torch threads: beside a
  # starting 7B server (inductor's compile workers) the CPU-side tests took 8.5 min of 32 threads
  # instead of 20 s (2026-11-30c).
  OMNI_TEST_LOG_DIR=$R/testlogs OMP_NUM_THREADS=${TESTS_THREADS:-4} \
    timeout -s INT -k 30 ${TESTS_TIMEOUT:-1200} python3 -m pytest -p no:cacheprovider -q -rf --durations=15 $TESTS > $R/tests.log 2>&1
  say "CUDA e2e tests: $(tail -1 $R/tests.log)"
}

step_talker() {
  # The 7B talker's decoder shape alone, batch 1 and 16: plain vLLM greedy vs with the talker's
  # sampling (temperature, top-k, top-p, repetition penalty), and our stage loop with it. At c=1
  # the served talker is host-bound (2026-11-30g: 4.7 ms per step, 1.8 ms of GPU work): how much
  # of a step is vLLM's sampler, and how much does omni-server's (talker-omni, as served) save?
  free_gpus
  for run in "vllm greedy" "vllm talker" "vllm talker-omni" "omni-plain talker" "omni-plain talker-omni"; do
    set -- $run
    timeout 300 python3 benchmarks/runner_overhead.py --model talker-7b --mode $1 --sampling $2 --batch 1 16 \
      > $R/talker_$1_$2.txt 2>&1
    say "talker $1 $2: $(grep RESULT $R/talker_$1_$2.txt | cut -c1-200 | tr '\n' ' ')"
  done
  # Where a batch-1 step goes with each sampler: torch-profiler tables of 20 steps (2026-12-01 they
  # showed our sampler's host sync: 1.2 ms per step in cudaStreamSynchronize).
  for s in talker talker-omni; do
    OMNI_PROFILE=dir=$R/prof_talker_$s,batch=1,skip=40,steps=20 timeout 200 python3 benchmarks/runner_overhead.py \
      --model talker-7b --mode omni-plain --sampling $s --batch 1 --repeats 1 > $R/talker_prof_$s.txt 2>&1
    say "talker $s profiled: $(head -1 $R/prof_talker_$s/runner.txt 2>/dev/null)"
  done
}

step_runner() {
  free_gpus; wait_tests  # alone on the machine: host load skews the batch-32 ratio
  for mode in vllm omni; do
    timeout 400 python3 benchmarks/runner_overhead.py --model qwen2-7b --mode $mode --batch 1 32 > $R/runner_$mode.txt 2>&1
    say "runner $mode: $(grep RESULT $R/runner_$mode.txt | tr '\n' ' ')"
  done
  # Where a batch-1 step of our loop goes (0.959 of vLLM on 2026-11-30d, 1.005 the run before):
  # torch-profiler tables and a trace of 50 steps (omni_server/stage/profiling.py).
  OMNI_PROFILE=dir=$R/prof_runner,batch=1,skip=100,steps=50,trace=1 timeout 300 python3 benchmarks/runner_overhead.py \
    --model qwen2-7b --mode omni --batch 1 --repeats 1 > $R/runner_prof.txt 2>&1
  say "runner profiled (rc $?): $(ls $R/prof_runner 2>/dev/null | tr '\n' ' ')"
  # RUNNER_TINY=1: the tiny thinker too (float32, as the tests run it), whose steps are all host
  # time, and our stage loop without emission (omni-plain). Off by default: on 2026-11-30d its
  # vLLM batch-32 runs spread 5,246-10,660 tok/s, too wide to read a few percent from.
  [ -n "${RUNNER_TINY:-}" ] || return 0
  local tiny="benchmarks/runner_overhead.py --model $PWD/var/models/tiny-qwen2_5-omni --dtype float32"
  for mode in vllm omni omni-plain; do
    timeout 300 python3 $tiny --mode $mode --batch 1 32 > $R/runner_tiny_$mode.txt 2>&1
    say "runner tiny $mode: $(grep RESULT $R/runner_tiny_$mode.txt | tr '\n' ' ')"
  done
}
# With two GPUs the CUDA tests (~10 min) run on GPU 1 in the background from the start; the steps
# that need GPU 1 wait for them, the others use GPU 0 only meanwhile. (Not the runner benchmark:
# beside a busy GPU 0 its bs32 ratio read 0.754 on 2026-11-30, 0.938 alone the run before.)
TESTS_BG=""
if [ "$NGPU" -ge 2 ] && [[ " $STEPS " == *" tests "* ]]; then
  ( export CUDA_VISIBLE_DEVICES=1; step_tests ) &
  TESTS_BG=$!
  STEPS=$(echo " $STEPS " | sed 's/ tests / /')
  say "CUDA tests started on GPU 1 in the background"
fi
wait_tests() { if [ -n "$TESTS_BG" ]; then wait $TESTS_BG; TESTS_BG=""; fi; }
for step in $STEPS; do step_$step; done
free_gpus; wait_tests
python3 benchmarks/collect.py $R --out $R/results.json > /dev/null 2>&1
say "DONE"
