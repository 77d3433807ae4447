# Wait up to ${WAIT:-540} s for session.sh to print DONE (or for progress), then pack /tmp/res into $OUT.
for i in $(seq 1 ${WAIT:-540}); do
  grep -q "DONE" /tmp/res/progress.log 2>/dev/null && break
  sleep 1
done
cat /tmp/res/progress.log
tar -czf $OUT/res.tar.gz -C /tmp res 2>/dev/null
ls -la $OUT
