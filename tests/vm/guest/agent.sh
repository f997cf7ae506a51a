#!/bin/bash
# Guest side of tests/vm/run.sh: run every command file the host drops into the shared
# directory /mnt/out/cmd (NAME.sh), each in the background with lib.sh loaded; its output
# goes to NAME.out and its exit status to NAME.rc. A file named "quit" ends the guest.
CMD=/mnt/out/cmd
mkdir -p "$CMD"
echo "AGENT-READY uptime=$(cut -d' ' -f1 /proc/uptime)"
while [ ! -e "$CMD/quit" ]; do
  for f in "$CMD"/*.sh; do
    [ -e "$f" ] || continue
    n=${f%.sh}
    mv "$f" "$n.run"
    ( bash -c "source /mnt/scripts/lib.sh; source $n.run" >"$n.out" 2>&1
      echo $? >"$n.rc.tmp"; mv "$n.rc.tmp" "$n.rc" ) &
  done
  sleep 0.2
done
echo "AGENT-QUIT uptime=$(cut -d' ' -f1 /proc/uptime)"
