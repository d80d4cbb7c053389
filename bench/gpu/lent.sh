#!/usr/bin/env bash
# One call on a lent device (the workplace's device tool, which carries .kit/ and returns
# what is under $OUT): unpack the kit once, run run.sh's STEPS within SECONDS, and leave
# the results as $OUT/NAME.tgz, also when the time ran out (whatever run.sh wrote by then).
#
#   bash bench/gpu/lent.sh NAME STEPS SECONDS [run.sh options...]
#
# e.g. bash bench/gpu/lent.sh tests build,test 300; bash bench/gpu/lent.sh benches bench 300
set -uo pipefail
NAME=$1 STEPS=$2 LIMIT=$3
shift 3
KIT=/tmp/ggufq-gpu-kit
RESULTS=/tmp/results-$NAME
if [ ! -x "$KIT/run.sh" ]; then
  if [ ! -f .kit/ggufq-gpu-kit.tar.gz ]; then
    echo "no kit here, nor unpacked in $KIT by an earlier call (the machine went cold?)"
    exit 2
  fi
  tar -xzf .kit/ggufq-gpu-kit.tar.gz -C /tmp
fi
# llama-server travels apart (pack.sh --prebuilt): in this call's .kit/, unpacked beside
if [ -f .kit/ggufq-gpu-server.tar.gz ]; then tar -xzf .kit/ggufq-gpu-server.tar.gz -C /tmp; fi
started=$SECONDS
timeout --signal=TERM --kill-after=10 "$LIMIT" "$KIT/run.sh" --steps "$STEPS" --out "$RESULTS" "$@"
status=$?
echo "run.sh --steps $STEPS: exit $status after $((SECONDS - started)) s (limit $LIMIT s)" \
  | tee -a "$RESULTS/run.log"
tar -czf "${OUT:-/tmp}/$NAME.tgz" -C /tmp "results-$NAME"
exit "$status"
