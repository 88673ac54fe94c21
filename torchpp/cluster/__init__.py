"""Emulated clusters on one Linux machine: CPU and memory limits (cgroups), link rates, delays
and losses (tc), and hosts as network namespaces on a private bridge.

Commands (root, or CAP_SYS_ADMIN + CAP_NET_ADMIN; without them they say which is missing):

    torchpp throttle cpu 0.5 [--mem 2G] -- python train.py   # limits for one command tree
    torchpp throttle mem 1G --pid 1234                       # limit a running process tree
    torchpp throttle net --dev eth0 --rate 10mbit [--delay 5ms] [--dst 10.0.0.2=5mbit] [-- CMD]
    torchpp throttle status | clear
    torchpp cluster up -c configs/cluster/pi3.json [--skip-netem]
    torchpp cluster run -n pi3 [--timeout S] -- torchrun --nproc-per-node 1 -m torchpp.train ...
    torchpp cluster run -n pi3 -- python -m torchpp bandwidth probe
    torchpp cluster run -n pi3 --plan plan.json -- python -m torchpp.train --plan plan.json  # a process per rank
    torchpp cluster status | down -n pi3

Modules: ``units`` (rates, sizes, durations), ``system`` (capabilities, `ip`/`tc` calls),
``cgroups`` (v1/v2 limits), ``tc`` (htb + netem shaping), ``netns`` (namespaces, veth,
bridge), ``config`` (cluster files), ``cluster`` (up/run/down/status), ``probe``
(`torchpp bandwidth probe`), ``cli`` (argument parsing).

Everything created is named ``torchpp*`` (namespaces ``torchpp-<cluster>-<host>``, cgroups
``torchpp/...``, qdisc handle ``7470:``, state in ``/run/torchpp``), so ``clear`` and ``down``
remove exactly that.
"""
