source tests/gpu/device_env.sh >/dev/null 2>&1 || exit 1
one() {  # one NAME CONFIG MODE
  ( sleep 55; ps -eo pid,stat,wchan:30,etime,cmd | grep -v grep | grep "rank.py\|torch.distributed.run" > $OUT/$1_ps.txt
    for p in $(pgrep -f "dbg/rank.py --config"); do tr "\0" " " < /proc/$p/cmdline | grep -q torch.distributed.run || kill -USR1 $p; done
    sleep 4; ps -eo pid,stat,wchan:30,cmd | grep -v grep | grep "rank.py" >> $OUT/$1_ps.txt; pkill -9 -f "dbg/rank.py" ) & w=$!
  t=$(date +%s)
  DBG_MODE=$3 timeout 70 python3 -m torch.distributed.run --nproc-per-node 2 --master-port $((29500 + RANDOM % 400)) dbg/rank.py --config dbg/$2.json --run-dir /tmp/dbg/$1 > $OUT/$1.log 2>&1
  echo "$1 rc=$? in $(( $(date +%s) - t ))s"; kill $w 2>/dev/null; wait $w 2>/dev/null
  grep "\[dbg" $OUT/$1.log
}
one tp2_plain tp2 plain
one tp2_nograph tp2_nograph plain
one tp2_fix tp2 fix
one pp2_plain pp2 plain
one tp2_exit tp2 exit
