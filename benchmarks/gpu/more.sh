# More steps after the running session: waits for its DONE, then runs session.sh again with STEPS
# (e.g. a step that failed, after a fix that this call's working tree brings), adding to /tmp/res.
#   STEPS="qwen3" bash benchmarks/gpu/more.sh; WAIT=... bash benchmarks/gpu/poll.sh
# (poll.sh then waits for the new DONE: the old one is renamed.)
setsid bash -c 'while ! grep -q "DONE" /tmp/res/progress.log 2>/dev/null; do sleep 2; done
  sed -i "s/: DONE\$/: done (first part)/" /tmp/res/progress.log
  MORE=1 exec bash benchmarks/gpu/session.sh' > /tmp/session.more.out 2>&1 < /dev/null &
sleep 1
