source benchmarks/gpu/setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
mkdir -p $OUT/logs
OMNI_TEST_LOG_DIR=$OUT/logs timeout 540 python3 -m pytest -p no:cacheprovider -q -x tests/test_e2e_speech.py tests/test_e2e_two_stage.py 2>&1 | tee $OUT/tests.log | tail -60
