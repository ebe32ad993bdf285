#!/usr/bin/env bash
# Claim 4: FedNNNN converges faster than (and ends above) FedAvg, Norm-Norm and Momentum
# alone (fednnnn.md Table 2, CIFAR-10 non-IID-B: 76.7 vs 72.6 / 76.7 / 74.3; Fig. 7 for the curves).
#
#   DATA_DIR=/path/to/cifar10 [SEEDS="0 1 2"] bash benchmarks/reproduce/fednnnn.sh [small|paper]
#
# Runs go to runs/reproduce/fednnnn-<scale>/{fedavg,normnorm,momentum,fednnnn}/seed<k>, all with
# fednnnn.py (its FedAvg flags reproduce fedavg.py bit for bit); beta/gamma from Table 5 (non-IID-B).
# (FedProx, Table 2's 74.2, is one more line: --beta 1 --gamma 0 --no-normalize --prox-mu 0.015.)
source "$(dirname "$0")/lib.sh"
setup "$@"

if [ "$SCALE" = small ]; then
  # CPU: one thread, at most 15 min per seed and variant (estimate in benchmarks/README.md).
  # Reductions vs the paper (fednnnn.md Table 1, non-IID-B: cnn6 with BN, K=100 clients with 2 shards,
  # C=1 (all clients every round), E=5, B=50, lr 0.05, weight decay 5e-4, 250 rounds):
  #   --model cnn6-narrow     cnn6 with 32/64/128 channels (3 ms/sample CPU) -> 8/16/32 (0.6-0.9 ms/sample);
  #                           batch norm with running statistics, which FedNNNN's evaluation model averages
  #   --frac 0.1              C=1 -> 0.1 (10 clients per round)
  #   --local-epochs 2        E=5 -> 2
  #   --rounds 100            250 -> 100
  #   --eval-every 5          every round -> every 5th (and the last)
  # Kept: 100 clients with 2 shards, B=50, SGD lr 0.05 without momentum, weight decay 5e-4, no augmentation.
  COMMON=(--model cnn6-narrow --num-clients 100 --shards 2 --frac 0.1 --local-epochs 2 --rounds 100 --eval-every 5
          --batch-size 50 --lr 0.05 --momentum 0 --weight-decay 5e-4 --augment none)
else
  # GPU, the paper's setting (Table 1, non-IID-B): cnn6, 100 clients, 2 shards each, all every round,
  # E=5, B=50, lr 0.05, weight decay 5e-4, 250 rounds.
  COMMON=(--model cnn6 --num-clients 100 --shards 2 --frac 1 --local-epochs 5 --rounds 250
          --batch-size 50 --lr 0.05 --momentum 0 --weight-decay 5e-4 --augment none)
fi

run fednnnn fedavg   fednnnn.py "${COMMON[@]}" --beta 1 --gamma 0 --no-normalize    # FedAvg (Eq. 1)
run fednnnn normnorm fednnnn.py "${COMMON[@]}" --beta 0.6 --gamma 0                 # Norm-Norm (Eq. 8)
run fednnnn momentum fednnnn.py "${COMMON[@]}" --beta 1 --gamma 0.9 --no-normalize  # Momentum (Eqs. 10-11)
run fednnnn fednnnn  fednnnn.py "${COMMON[@]}" --beta 0.6 --gamma 0.7               # FedNNNN (Eqs. 12-13)
finish
