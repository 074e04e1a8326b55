H=build/prebuilt/h256-6a24763/sm90_bwd_harness
nvidia-smi --query-gpu=name,driver_version --format=csv > $OUT/num.log
timeout 150 $H --no-perf >> $OUT/num.log 2>&1; echo "rc=$?" >> $OUT/num.log
grep -c PASS $OUT/num.log; grep "FAIL\|cases passed\|rc=" $OUT/num.log | head -20
( timeout 60 $H --perf-only --shape 6; timeout 60 $H --perf-only --shape 6 --softcap 50; timeout 60 $H --perf-only --shape 0 ) > $OUT/perf.log 2>&1
cat $OUT/perf.log | grep -v "^device"
for tool in racecheck synccheck memcheck; do timeout 120 compute-sanitizer --tool $tool --error-exitcode 9 $H --small > $OUT/san_$tool.log 2>&1; echo "$tool rc=$?"; tail -2 $OUT/san_$tool.log; done
if grep -q "rc=0" $OUT/num.log; then
  STAGES="build test" TESTS="test_cudnn.py test_cudnn_features.py" TEST_K="sm90 or h256" TEST_TIMEOUT=300 OUT=$OUT/gc tools/gpu_check.sh > $OUT/check.log 2>&1; echo "gpu_check rc $?"; tail -4 $OUT/gc/test.log
  pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl 2>/dev/null
  PYTHONPATH=$PWD/build/gpu_site:/tmp/site timeout 150 python3 bench/gpu_kernels.py --impl sm90 --bwd --variants "fwd+bwd,cudnn fwd+bwd,cap50 fwd+bwd" --shapes 5 --calls 3 > $OUT/k256.log 2>&1; grep "^|" $OUT/k256.log
fi
