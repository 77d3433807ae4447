source benchmarks/gpu/setup.sh
t0=$(date +%s)
python3 benchmarks/qwen2_5_omni_shape.py --out /tmp/omni7b --size 7b --device cuda 2>&1 | tail -3
echo "shape build: $(( $(date +%s) - t0 )) s"
M=/tmp/omni7b
setsid python3 -m omni_server.cli serve configs/qwen2_5_omni.yaml --port 8010 \
  --stage-arg thinker.model=$M --stage-arg talker.model=$M --stage-arg token2wav.model=$M \
  --stage-arg thinker.load_format=dummy --stage-arg talker.load_format=dummy \
  --stage-arg talker.default_sampling.max_tokens=${TALKER_MAX:-500} > $OUT/serve7b.log 2>&1 &
t1=$(date +%s)
for i in $(seq 1 400); do
  if curl -s localhost:8010/health | grep -q '"ok"'; then break; fi; sleep 1
done
echo "ready after $(( $(date +%s) - t1 )) s"; curl -s localhost:8010/health; echo
B="python3 -m omni_server.cli bench --base-url http://127.0.0.1:8010 --model qwen2.5-omni --max-tokens 100 --audio"
$B --concurrency 1 --requests 1 --output $OUT/warm7b.json
$B --concurrency 1 --requests 3 --output $OUT/bench7b_c1.json
$B --concurrency 16 --requests 16 --output $OUT/bench7b_c16.json
# p4: the same prompts through transformers' generate() on this GPU (one at a time), ours / theirs.
$B --concurrency 16 --requests 16 --reference $M --reference-talker-max-tokens ${TALKER_MAX:-500} \
  --reference-requests 2 --output $OUT/bench7b_c16_ref.json
python3 - <<'PY'
import time, openai
c = openai.OpenAI(base_url="http://127.0.0.1:8010/v1", api_key="x")
t = time.perf_counter()
r = c.chat.completions.create(model="qwen2.5-omni", messages=[{"role": "user", "content": "Hello, who are you?"}],
                              max_tokens=100, extra_body={"ignore_eos": True}, audio={"voice": "Chelsie", "format": "wav"})
print("one text+audio chat:", round(time.perf_counter() - t, 3), "s, audio b64 chars", len(r.choices[0].message.audio.data))
PY
nvidia-smi --query-gpu=memory.used,memory.total --format=csv
grep -a "ready in\|engine start\|Traceback\|Error" $OUT/serve7b.log | grep -v Triton | head -20
# TTFP streaming vs full payload (issue #4): the same server with token2wav waiting for all codes.
pkill -f "omni_server.cli serve" ; sleep 5
setsid python3 -m omni_server.cli serve configs/qwen2_5_omni.yaml --port 8010 \
  --stage-arg thinker.model=$M --stage-arg talker.model=$M --stage-arg token2wav.model=$M \
  --stage-arg thinker.load_format=dummy --stage-arg talker.load_format=dummy \
  --stage-arg talker.default_sampling.max_tokens=${TALKER_MAX:-500} --stage-arg token2wav.input_mode=full \
  > $OUT/serve7b_full.log 2>&1 &
for i in $(seq 1 400); do
  if curl -s localhost:8010/health | grep -q '"ok"'; then break; fi; sleep 1
done
$B --concurrency 1 --requests 1 --output $OUT/warm7b_full.json
$B --concurrency 1 --requests 3 --output $OUT/bench7b_c1_full.json
$B --concurrency 16 --requests 16 --output $OUT/bench7b_c16_full.json
python3 benchmarks/collect.py $OUT --out $OUT/results.json   # copy to benchmarks/results/<date>-h200.json
