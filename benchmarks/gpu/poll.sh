# Wait up to ${WAIT:-540} s for session.sh to print DONE (or for progress), then pack /tmp/res into $OUT:
# res.tar.gz without the profiler traces, traces.tar.gz with them (a file comes back only under 16 MiB,
# so large traces cannot cost the results).
# A machine without a session (a fresh one: the held one was taken back) says so at once instead of
# waiting out WAIT (2026-12-02: 540 s of device time lost that way).
# One deadline for both waits (a call may run 600 s, packing included).
end=$((SECONDS + ${WAIT:-540}))
while [ ! -f /tmp/res/progress.log ] && [ $SECONDS -lt $end ] && [ $SECONDS -lt 60 ]; do sleep 1; done  # (set-up writes it: ~20 s)
if [ ! -f /tmp/res/progress.log ]; then echo "no session on this machine (fresh start?)"; exit 3; fi
while [ $SECONDS -lt $end ]; do
  grep -q "DONE" /tmp/res/progress.log 2>/dev/null && break
  sleep 1
done
cat /tmp/res/progress.log
tar -czf $OUT/res.tar.gz -C /tmp --exclude='res/prof*/*.json' res 2>/dev/null
traces=$(cd /tmp && ls -d res/prof*/*.json 2>/dev/null)
[ -z "$traces" ] || tar -czf $OUT/traces.tar.gz -C /tmp $traces 2>/dev/null
ls -la $OUT
