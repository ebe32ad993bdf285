#!/usr/bin/env bash
# Claim 1: FedFN beats FedAvg under heavy label skew on CIFAR-10
# (fedfn.md Table 1, VGG11: s=2 77.77 vs 74.24; s=10 83.80 vs 81.97).
#
#   DATA_DIR=/path/to/cifar10 [SEEDS="0 1 2"] [SHARDS="2 10"] [ALPHAS="0.1 0.5"] \
#     bash benchmarks/reproduce/fedfn.sh [small|proxy|paper]
#
# SHARDS: the values of s (default "2 10"; empty: none). ALPHAS: Dirichlet rows (Table 8: 0.1, 0.3, 0.5, 1.0;
# default none). Runs go to runs/reproduce/fedfn-{s2,s10,a0.1,...}-<scale>/{fedavg,fedfn}/seed<k>; tables:
# benchmarks/collect.py.
# Both variants run fedfn.py (FedAvg = --no-fn on the same code path), each with its paper lr.
source "$(dirname "$0")/lib.sh"
setup "$@"

if [ "$SCALE" = small ]; then
  # CPU: one thread, at most 15 min per seed and variant (estimate in benchmarks/README.md).
  # Reductions vs the paper (fedfn.md B.2: VGG11, N=100, r=0.1, E=15, R=320, B=50):
  #   --model convnet4-tiny   VGG11 (23 ms/sample CPU) -> FedBABU's 4convNet with 8 channels (0.36 ms/sample)
  #   --local-epochs 5        E=15 -> 5
  #   --rounds 50             R=320 -> 50 (lr still x0.1 at 1/2 and 3/4 of the run)
  #   --eval-every 5          every round -> every 5th (and the last)
  # Kept: N=100 clients, r=0.1, s shards per client, B=50, momentum 0.9, no weight decay, the lrs.
  COMMON=(--model convnet4-tiny --num-clients 100 --frac 0.1 --local-epochs 5 --rounds 50 --eval-every 5)
elif [ "$SCALE" = proxy ]; then
  # CPU, one thread, 8 s a round, about 28 min a run (12 runs: about 2.8 h with JOBS=2; measured on the shared
  # 2-core VM): a model that keeps what FN acts on. vgg11-narrow (VGG11 at a quarter width, no batch norm,
  # d = 512) starts with VGG11's feature norm (0.593 vs 0.597) and head-row norm (0.578 vs 0.575), where
  # convnet4-tiny's batch-normed feature is 10.9x larger (benchmarks/proxy_properties.py); 0.77 ms/image.
  #   --local-epochs 2 --rounds 200   E=15, R=320 -> 2, 200: more rounds than epochs, so the head's rows have
  #                                   time to grow (--analyze every logs head_row_norm and feature_norm)
  #   --eval-every 10                 every round -> every 10th (and the last)
  # Kept: N=100, r=0.1, s shards, B=50, momentum 0.9, no weight decay, the lrs, lr x0.1 at 1/2 and 3/4.
  COMMON=(--model vgg11-narrow --num-clients 100 --frac 0.1 --local-epochs 2 --rounds 200 --eval-every 10 --analyze every)
else
  # GPU, the paper's setting (fedfn.md Sec. 5 / B.2): VGG11, N=100, r=0.1, E=15, R=320, B=50.
  COMMON=(--model vgg11 --num-clients 100 --frac 0.1 --local-epochs 15 --rounds 320)
fi

for s in ${SHARDS-2 10}; do  # SHARDS: only these settings of s (default both; SHARDS= none)
  run "fedfn-s$s" fedavg fedfn.py "${COMMON[@]}" --shards "$s" --no-fn --lr 0.01  # FedAvg: lr 0.01 (paper's default for CIFAR-10)
  run "fedfn-s$s" fedfn  fedfn.py "${COMMON[@]}" --shards "$s" --lr 0.03          # FedFN: lr 0.03 (grid search, App. C)
  if [ "$SCALE" = small ]; then  # controls (ours): FedFN at FedAvg's lr, so lr alone does not decide the comparison;
    # and the same with the unit feature scaled to norm sqrt(d) (FedLN's FN), since z = W f/||f|| bounds each logit
    # by ||W_c|| (about 0.6 at PyTorch's head init) and a short schedule does not grow W enough
    run "fedfn-s$s" fedfn-lr0.01 fedfn.py "${COMMON[@]}" --shards "$s" --lr 0.01
    run "fedfn-s$s" fedfn-sqrtd  fedfn.py "${COMMON[@]}" --shards "$s" --lr 0.01 --fn-scale sqrt-d
  fi
done

for a in ${ALPHAS-}; do  # Table 8's Dirichlet rows (Dir(alpha) per class over 100 clients; one seed in the paper)
  run "fedfn-a$a" fedavg fedfn.py "${COMMON[@]}" --alpha "$a" --no-fn --lr 0.01
  run "fedfn-a$a" fedfn  fedfn.py "${COMMON[@]}" --alpha "$a" --lr 0.03
  if [ "$SCALE" = proxy ] && [ "$a" = 0.1 ]; then  # one-seed controls (the first of SEEDS) where FN's norm runs away:
    # FedFN at FedAvg's lr; FN scaled to sqrt(d); and the weight decay of the code Table 8 ran on (FedNTD's
    # config: SGD momentum 0.9, weight decay 1e-5; the paper names none), for both methods
    SEEDS=${SEEDS%% *} run "fedfn-a$a" fedfn-lr0.01 fedfn.py "${COMMON[@]}" --alpha "$a" --lr 0.01
    SEEDS=${SEEDS%% *} run "fedfn-a$a" fedfn-sqrtd fedfn.py "${COMMON[@]}" --alpha "$a" --lr 0.03 --fn-scale sqrt-d
    SEEDS=${SEEDS%% *} run "fedfn-a$a" fedavg-wd1e-5 fedfn.py "${COMMON[@]}" --alpha "$a" --no-fn --lr 0.01 \
      --weight-decay 1e-5
    SEEDS=${SEEDS%% *} run "fedfn-a$a" fedfn-wd1e-5 fedfn.py "${COMMON[@]}" --alpha "$a" --lr 0.03 --weight-decay 1e-5
    # More local work, toward the paper's E=15: FN's norm grows inside local training, so E decides how far it runs
    e5=("${COMMON[@]}")
    for i in "${!e5[@]}"; do [ "${e5[$i]}" = --local-epochs ] && e5[i + 1]=5; done
    run "fedfn-a$a" fedavg-e5 fedfn.py "${e5[@]}" --alpha "$a" --no-fn --lr 0.01
    run "fedfn-a$a" fedfn-e5 fedfn.py "${e5[@]}" --alpha "$a" --lr 0.03
  fi
done
finish
