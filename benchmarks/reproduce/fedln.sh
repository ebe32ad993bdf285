#!/usr/bin/env bash
# Claim 3: layer and feature normalization rescue FedAvg when each client holds one class
# (fedln.md Table 10, CNN, E=10: FedLN 78.04, FedFN 77.14 vs FedAvg 55.86), and batch norm does not
# (Table 4: FedAvg + BN 9.63).
#
#   DATA_DIR=/path/to/cifar10 [SEEDS="0 1 2"] bash benchmarks/reproduce/fedln.sh [small|paper]
#
# Runs go to runs/reproduce/fedln-<scale>/{ln,fn,vanilla,bn}/seed<k>, all with fedln.py --norm X.
# (FedGN, Table 4's 77.15, is one more line: run fedln gn fedln.py "${COMMON[@]}" --norm gn.)
source "$(dirname "$0")/lib.sh"
setup "$@"

if [ "$SCALE" = small ]; then
  # CPU: one thread, at most 15 min per seed and variant (estimate in benchmarks/README.md).
  # Reductions vs the paper (fedln.md App. C.3, Tables 7-9: normcnn with 64 channels, 10 clients with
  # one class each, all every round, 10 local steps of B=32, SGD lr 0.01, 10,000 rounds):
  #   --width 16              conv channels 64 -> 16 (1.9 -> 0.4 ms/sample CPU); dense 384 and the head kept
  #   --rounds 300            10,000 -> 300
  #   --eval-every 20         every 100th -> every 20th round (and the last)
  # Kept: 10 clients, one class each, full participation, E=10 steps, B=32, lr 0.01, no momentum.
  COMMON=(--model normcnn --width 16 --num-clients 10 --frac 1 --classes-per-client 1 --local-steps 10 --batch-size 32 --lr 0.01 --rounds 300 --eval-every 20)
else
  # GPU, the paper's setting (App. C.3): normcnn (Table 7, 64 channels), 10 clients, 1 class each,
  # E=10 steps, B=32, lr 0.01, 10,000 rounds, evaluation every 100.
  COMMON=(--model normcnn --width 64 --num-clients 10 --frac 1 --classes-per-client 1 --local-steps 10 --batch-size 32 --lr 0.01 --rounds 10000 --eval-every 100)
fi

run fedln ln      fedln.py "${COMMON[@]}" --norm ln    # FedLN: layer norm after each activation
run fedln fn      fedln.py "${COMMON[@]}" --norm fn    # FedFN (FedLN paper's sqrt(d) scaling)
run fedln vanilla fedln.py "${COMMON[@]}" --norm none  # FedAvg, no normalization
run fedln bn      fedln.py "${COMMON[@]}" --norm bn    # FedAvg + BN, running statistics averaged
finish
