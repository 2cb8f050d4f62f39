#!/usr/bin/env python3
"""Where the nested Xen rig's CPU goes during each iperf3 run: a sampling profile of
the emulated CPUs, taken from outside (nothing runs in the guests to take it).

    sudo python3 scripts/xen_profile.py [--seconds 15] [--hz 50]
        [--backend gsonet kernel-netback] [--pin] [--streams N] [--rate 50M]
        [--domu-vcpus N]

It boots the rig once with the chosen scenarios (guest-tests/xen/scenarios/) and a
QEMU monitor socket, and while a `measure` of the scenario runs (its XT-MEASURE
markers on the console) it asks the monitor for every vCPU's registers `--hz` times a
second. Each sample's RIP goes to a bucket: a function of Xen (symbols from the
hypervisor's debug package, fetched once), of the guests' 6.12 kernel or of a module
(dom0 and the domUs run the same binary; the symbols are dom0's /proc/kallsyms, sent
once over the console, gzip + base64), of gsonet (its mappings are sent with each
run, XT-MAPS), a library gsonet maps, other user space, or a halted vCPU. Prints, per
measured run, the share of each bucket and the top functions. Samples are of the
emulated machine, so they count TCG's cost of each guest instruction, which is what
the rig's throughput is made of. With `--pin`, dom0 runs on emulated CPU 0 only and
the domU on CPU 1 only, so each CPU's samples are one domain's and are shown apart.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import collections
import gzip
import json
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "guest-tests"))

from harness import paths, xen  # noqa: E402
from harness.process import connect_unix  # noqa: E402

XEN_RANGE = (0xFFFF82D040000000, 0xFFFF82D0C0000000)
USER_TOP = 0x0000800000000000
REG = re.compile(r"RIP=([0-9a-f]{16}) .*?HLT=(\d)")


def xen_symbols() -> tuple[list[int], list[str]]:
    """Xen's own text symbols, from the hypervisor's debug package (the same version
    the rig boots), fetched once into the rig's cache with apt-get download; empty
    when that fails (Xen's samples are then one bucket)."""
    cache = paths.GUEST_TESTS / ".cache" / "xen" / "dbg"
    maps = sorted(cache.glob("**/xen-syms-*.map"))
    if not maps:
        cache.mkdir(parents=True, exist_ok=True)
        got = subprocess.run(
            "apt-get download -q -o APT::Sandbox::User=root xen-hypervisor-4.17-amd64-dbg"
            " && dpkg-deb -x xen-hypervisor-4.17-amd64-dbg_*.deb .",
            shell=True, cwd=cache, capture_output=True, text=True)
        if got.returncode != 0:
            print(f"no Xen symbols: {got.stderr.strip()[-300:]}", file=sys.stderr)
        maps = sorted(cache.glob("**/xen-syms-*.map"))
    syms = []
    for m in maps[:1]:
        for line in m.read_text().splitlines():
            addr, kind, name = (line.split() + ["", ""])[:3]
            if kind.lower() == "t":
                syms.append((int(addr, 16), f"xen:{name}"))
    syms.sort()
    return [a for a, _ in syms], [n for _, n in syms]


def user_symbols(text: str) -> dict[str, list[tuple[int, int, int, str]]]:
    """Per measured run, gsonet's executable mappings (XT-MAPS lines: run, range,
    file offset, file) as (start, end, offset, file); samples in them are named by
    `binary`'s symbols (the gsonet file) or by the library's file name."""
    maps: dict[str, list[tuple[int, int, int, str]]] = collections.defaultdict(list)
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 5 and parts[0] == "XT-MAPS":
            lo, hi = (int(x, 16) for x in parts[2].split("-"))
            maps[parts[1]].append((lo, hi, int(parts[3], 16), parts[4]))
    return maps


def elf_segments(binary: str) -> list[tuple[int, int, int]]:
    """A binary's LOAD segments as (file offset, size, address): a mapping's file
    offset is not its symbols' address when the two differ (lld's layout)."""
    out = subprocess.run(["readelf", "-lW", binary], capture_output=True, text=True).stdout
    return [(int(f[1], 16), int(f[4], 16), int(f[2], 16))
            for f in (line.split() for line in out.splitlines()) if f[:1] == ["LOAD"]]


def file_to_addr(segments: list[tuple[int, int, int]], off: int) -> int:
    for start, size, addr in segments:
        if start <= off < start + size:
            return off - start + addr
    return off


def elf_symbols(binary: str, dynamic: bool = False) -> tuple[list[int], list[str]]:
    """A binary's function symbols (demangled, hashes dropped), by address; with
    ``dynamic``, those of its dynamic table only (a stripped library's)."""
    out = subprocess.run(["nm", "-C", "--defined-only", *(["-D"] if dynamic else []), binary],
                         capture_output=True, text=True).stdout
    syms = []
    for line in out.splitlines():
        addr, _, rest = line.partition(" ")
        kind, _, name = rest.partition(" ")
        # t: code; i: an IFUNC (a library's memmove, resolved to a variant at load)
        if kind.lower() in ("t", "i") and addr:
            syms.append((int(addr, 16), re.sub(r"::h[0-9a-f]{16}$", "", name)))
    syms.sort()
    return [a for a, _ in syms], [n for _, n in syms]


def library_symbols(path: str) -> tuple[list[int], list[str]]:
    """A library's function symbols by address: the rig copies the host's libraries
    gsonet needs to the same paths in dom0, so the host's file names them. Its
    detached debug symbols (e.g. libc6-dbg, found by build id) when installed, which
    name the IFUNC variants (memmove's) the dynamic table lacks; else that table."""
    if not Path(path).is_file():
        return [], []
    notes = subprocess.run(["readelf", "-n", path], capture_output=True, text=True).stdout
    m = re.search(r"Build ID: ([0-9a-f]{2})([0-9a-f]+)", notes)
    debug = Path(f"/usr/lib/debug/.build-id/{m.group(1)}/{m.group(2)}.debug") if m else None
    if debug is not None and debug.is_file():
        return elf_symbols(str(debug))
    return elf_symbols(path, dynamic=True)


def kallsyms(text: str) -> tuple[list[int], list[str]]:
    """The text symbols dom0 sent (XT-KALLSYMS lines), sorted by address."""
    blob = "".join(l.split(" ", 1)[1] for l in text.splitlines()
                   if l.startswith("XT-KALLSYMS "))
    if not blob:
        return [], []
    syms = []
    for line in gzip.decompress(base64.b64decode(blob)).decode().splitlines():
        addr, _, name = line.partition(" ")
        syms.append((int(addr, 16), name))
    syms.sort()
    return [a for a, _ in syms], [n for _, n in syms]


class Monitor:
    def __init__(self, path: str):
        self.sock = connect_unix(path, 120)
        self.buf = b""
        self.read_prompt()

    def read_prompt(self) -> str:
        while b"(qemu) " not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("monitor closed")
            self.buf += chunk
        out, _, self.buf = self.buf.partition(b"(qemu) ")
        return out.decode(errors="replace")

    def jit_counts(self) -> dict[str, int]:
        """TCG's counters (`info jit`): TLB flushes among them, which a PV guest pays
        on every page-table switch (a context switch, a system call)."""
        self.sock.sendall(b"info jit\n")
        out = {}
        for line in self.read_prompt().splitlines():
            m = re.match(r"\s*([A-Za-z][A-Za-z /]+?)\s+(\d+)\s*$", line)
            if m:
                out[m.group(1).strip()] = int(m.group(2))
        return out

    def registers(self) -> list[tuple[int, bool]]:
        self.sock.sendall(b"info registers -a\n")
        return [(int(m.group(1), 16), m.group(2) == "1")
                for m in REG.finditer(self.read_prompt())]


def report(data: dict, top: int) -> None:
    """Prints each run's buckets and top functions from saved samples."""
    console = Path(data["console"]).read_text(errors="replace") if data["console"] else ""
    addrs, names = kallsyms(console)
    xen_addrs, xen_names = xen_symbols()
    maps = user_symbols(console)
    # Per file gsonet maps: its symbols and LOAD segments (gsonet's own from the
    # binary under test, a library's from the host's copy), read at first use.
    files: dict[str, tuple[tuple[list[int], list[str]], list[tuple[int, int, int]]]] = {}

    def user(rip: int, run_key: str) -> str:
        for lo, hi, off, path in maps.get(run_key, []):
            if lo <= rip < hi:
                own = path.endswith("/gsonet")
                name = "gsonet" if own else path.rsplit('/', 1)[-1]
                if path not in files:
                    binary = data["gsonet_bin"] if own else path
                    syms = elf_symbols(binary) if own else library_symbols(path)
                    files[path] = (syms, elf_segments(binary))
                (sym_addrs, sym_names), segments = files[path]
                i = bisect.bisect_right(sym_addrs, file_to_addr(segments, rip - lo + off)) - 1
                if i >= 0:
                    return f"{name}:{sym_names[i]}"
                return "gsonet:?" if own else f"(user) {name}"
        return "(user)"

    def where(rip, run_key: str) -> str:
        if isinstance(rip, str):
            return rip
        if XEN_RANGE[0] <= rip < XEN_RANGE[1]:
            i = bisect.bisect_right(xen_addrs, rip) - 1
            return xen_names[i] if i >= 0 else "(xen)"
        if rip < USER_TOP:
            return user(rip, run_key)
        i = bisect.bisect_right(addrs, rip) - 1
        return names[i] if i >= 0 else "(kernel, no symbols)"

    print(f"\nconsole: {data['console'] or '?'}")
    busy: dict[str, tuple[collections.Counter, float]] = {}
    for key, raw in data["samples"].items():
        run_key = key.split(" [")[0]
        c = collections.Counter()
        for rip, n in raw.items():
            c[where(rip if rip.startswith("(") else int(rip), run_key)] += n
        total = sum(c.values())
        mbps = data["results"].get(run_key)
        print(f"\n== {key}: {mbps} Mbit/s, {total} vCPU samples")
        try:
            gb = float(mbps) * data["seconds"] / 8000
        except (TypeError, ValueError):
            gb = 0
        if run_key in data["jit"] and gb:
            print("   per GB: " + ", ".join(f"{k} {v / gb:,.0f}"
                                         for k, v in data["jit"][run_key].items()))
        groups = collections.Counter()
        for w, n in c.items():
            group = "module" if w.endswith("]") else "kernel"
            if w.startswith("(user)") or w.startswith("gsonet:"):
                group = "(user)"
            elif w.startswith("xen:"):
                group = "(xen)"
            groups[w if w.startswith("(") and group != "(user)" else group] += n
        print("   " + ", ".join(f"{g} {100 * n / total:.1f}%" for g, n in groups.most_common()))
        for w, n in c.most_common(top):
            print(f"   {100 * n / total:5.1f}%  {w}")
        if gb:
            busy[key] = (c, float(mbps) / 1000)
    compare(busy, top)


def compare(busy: dict[str, tuple[collections.Counter, float]], top: int) -> None:
    """For each run of gsonet that has a kernel netback twin (same path and vCPU):
    busy samples per Gbit/s moved, side by side, and the functions whose share
    differs most. Samples come at a fixed rate, so this is CPU time per byte: what
    gsonet spends more (or less) than the kernel netback for the same traffic."""
    for key, (g, g_rate) in busy.items():
        if not key.startswith("gsonet."):
            continue
        twin = busy.get("kernel." + key[len("gsonet."):])
        if twin is None:
            continue
        k, k_rate = twin

        def per_gbit(c: collections.Counter, rate: float) -> dict[str, float]:
            return {w: n / rate for w, n in c.items() if w != "(halted)"}

        gp, kp = per_gbit(g, g_rate), per_gbit(k, k_rate)
        diffs = sorted(((gp.get(w, 0) - kp.get(w, 0), w) for w in set(gp) | set(kp)),
                       reverse=True)
        print(f"\n== {key[len('gsonet.'):]}: busy samples per Gbit/s, gsonet / kernel netback:"
              f" {sum(gp.values()):.0f} / {sum(kp.values()):.0f}")
        head = diffs[:top // 2]
        # The tail starts after the head: no row twice, and none at all for top < 4.
        shown = head + [None] + diffs[max(len(head), len(diffs) - top // 4):]
        for row in shown:
            if row is None:
                print("   ... gsonet spends less on:")
                continue
            d, w = row
            print(f"   {d:+7.1f}  ({gp.get(w, 0):6.1f} / {kp.get(w, 0):6.1f})  {w}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=int, default=15, help="iperf3 seconds per run")
    ap.add_argument("--hz", type=float, default=50, help="samples a second")
    ap.add_argument("--backend", nargs="+", default=["gsonet", "kernel-netback"],
                    choices=["gsonet", "kernel-netback"])
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--streams", type=int, default=1,
                    help="parallel TCP streams of the dom0 <-> domU runs (iperf3 -P)")
    ap.add_argument("--rate", default="",
                    help="iperf3's target rate (-b, e.g. 50M): the backends then move the "
                         "same bytes in the same time, and their profiles differ by what "
                         "each does per byte, not by the Xen's per-second costs")
    ap.add_argument("--domu-vcpus", type=int, default=1,
                    help="the domUs' vCPUs (a netfront asks for a queue per vCPU)")
    ap.add_argument("--domus", type=int, choices=(1, 2), default=1,
                    help="2 adds the domU -> domU runs (two domUs on the netback)")
    ap.add_argument("--pin", action="store_true",
                    help="dom0 on CPU 0, the domUs on CPU 1; profile each CPU apart")
    ap.add_argument("--replay", metavar="JSON",
                    help="print the profile of a run saved before (its samples.json)")
    args = ap.parse_args()
    if args.rate and not re.fullmatch(r"\d+(\.\d+)?[KMG]?", args.rate):
        ap.error(f"--rate {args.rate!r}: want iperf3's -b form, e.g. 50M")
    if args.replay:
        report(json.loads(Path(args.replay).read_text()), args.top)
        return 0
    reason = xen.skip_reason()
    if reason:
        sys.exit(f"cannot profile: {reason}")
    xen.build_rig()

    tmp = tempfile.mkdtemp(prefix="gsonet-xenprof-")
    mon_path = f"{tmp}/monitor.sock"
    env = {"XT_DOMU_CPUS": "1"} if args.pin else {}
    if args.domu_vcpus > 1:
        env["XT_DOMU_VCPUS"] = str(args.domu_vcpus)
    iperf = ([f"-P {args.streams}"] if args.streams > 1 else []) + (
        [f"-b {args.rate}"] if args.rate else [])
    if iperf:
        env["XT_IPERF_ARGS"] = " ".join(iperf)
    script = xen.scenario(*args.backend, XT_SECONDS=args.seconds, XT_PROFILE=1,
                          XT_DOMUS=args.domus, **env)
    rig = xen.XenRig("profile", script, gsonet="gsonet" in args.backend, monitor=mon_path,
                     timeout=3600, xen_args="dom0_vcpus_pin" if args.pin else "")
    result: dict = {}
    runner = threading.Thread(target=lambda: result.setdefault("run", rig.run(check=False)))
    runner.start()
    mon = Monitor(mon_path)

    # The console is streamed into the newest results/guest-logs/*-xen-profile-* file.
    log = None
    while log is None and runner.is_alive():
        logs = sorted(paths.REPO.glob("results/guest-logs/*-xen-profile-*.console.log"),
                      key=lambda p: p.stat().st_mtime)
        log = logs[-1] if logs and logs[-1].stat().st_mtime > time.time() - 60 else None
        time.sleep(0.5)
    samples: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    jit: dict[str, dict[str, int]] = {}
    jit_at_start: dict[str, int] = {}
    current = None
    period = 1.0 / args.hz
    console = open(log, errors="replace") if log is not None else None
    partial = ""
    while runner.is_alive() and console is not None:
        # Only what was written since the last look, whole lines only.
        partial += console.read()
        *lines, partial = partial.split("\n")
        for line in lines:
            if line.startswith("XT-MEASURE start "):
                current = line.split()[2]
                jit_at_start = mon.jit_counts()
            elif line.startswith("XT-MEASURE stop "):
                if current is not None:
                    end = mon.jit_counts()
                    jit[current] = {k: v - jit_at_start.get(k, 0) for k, v in end.items()
                                    if "flush" in k.lower()}
                current = None
        if current is None:
            time.sleep(0.2)
            continue
        t0 = time.monotonic()
        try:
            regs = mon.registers()
        except (OSError, EOFError):
            break
        for cpu, (rip, halted) in enumerate(regs):
            key = f"{current} [{('dom0', 'domU')[min(cpu, 1)]}]" if args.pin else current
            samples[key]["(halted)" if halted else rip] += 1
        time.sleep(max(0.0, period - (time.monotonic() - t0)))
    runner.join()
    if console is not None:
        console.close()
    run = result.get("run")
    data = {
        "console": str(run.log_path) if run else "",
        "results": dict(run.results) if run else {},
        "jit": jit,
        "seconds": args.seconds,
        "gsonet_bin": rig.gsonet_bin,
        "samples": {k: {str(r): n for r, n in c.items()} for k, c in samples.items()},
    }
    saved = Path(tmp) / "samples.json"
    saved.write_text(json.dumps(data))
    print(f"\nsamples: {saved} (--replay it to print again)")
    report(data, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
