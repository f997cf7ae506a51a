//! What the man pages have beyond clap's NAME, SYNOPSIS, DESCRIPTION and OPTIONS: EXAMPLES for
//! each command, and EXIT STATUS, ENVIRONMENT and FILES, in roff.

const TARGET: &[(&str, &str)] = &[
    (
        "A 1 GiB RAM namespace on 127.0.0.1, with a control socket for target-ns.",
        "nvmf-rdma target --listen 127.0.0.1 --ram 1G --control /run/nvmf-tgt.sock",
    ),
    (
        "A file namespace, created at 4 GiB if it does not exist.",
        "nvmf-rdma target --listen 192.0.2.10 --file /srv/disk.img --file-size 4G",
    ),
];

const TARGET_ANA: &[(&str, &str)] = &[
    (
        "Make ANA group 1 inaccessible through port 2 of a running target.",
        "nvmf-rdma target-ana set --control /run/nvmf-tgt.sock --port 2 inaccessible",
    ),
    (
        "Every port's groups and their states.",
        "nvmf-rdma target-ana status --control /run/nvmf-tgt.sock",
    ),
];

/// Examples of `command` ("nvmf-rdma" for the top page, else the subcommand's name): what it
/// does, then the command line.
pub(crate) fn examples(command: &str) -> &'static [(&'static str, &'static str)] {
    match command {
        "nvmf-rdma" => &[
            ("Try it: a built-in target and a host on loopback.", "nvmf-rdma demo"),
            (
                "Connect a subsystem through the daemon, mount it, and disconnect.",
                "nvmf-rdma connect -t rdma -a 192.0.2.10 -s 4420 -n nqn.2026-11.io.nvmf-rdma:demo --fuse /mnt/nvmf0",
            ),
            ("List the controllers.", "nvmf-rdma list"),
        ],
        "demo" => &[("Write, verify and read 64 MiB on loopback.", "nvmf-rdma demo --size 64M")],
        "hca-demo" => &[("RDMA WRITE and READ 32 MiB between two soft-HCAs.", "nvmf-rdma hca-demo --size 32M")],
        "bench" => &[
            ("The NVMe-oF table on loopback, 3 s per row.", "nvmf-rdma bench --seconds 3"),
            ("The raw soft-HCA rates.", "nvmf-rdma bench --hca"),
            (
                "Against your target, as JSON lines.",
                "nvmf-rdma bench -a 192.0.2.10 -n nqn.2026-11.io.nvmf-rdma:demo -o json",
            ),
        ],
        "target" => TARGET,
        "target-ana" => TARGET_ANA,
        "target-ns" => &[(
            "Add namespace 2 (256 MiB of RAM) to a running target.",
            "nvmf-rdma target-ns add --control /run/nvmf-tgt.sock --nsid 2 --ram 256M",
        )],
        "discover" => &[(
            "What a discovery controller offers.",
            "nvmf-rdma discover -t rdma -a 192.0.2.10 -s 4420",
        )],
        "daemon" => &[
            ("Start the daemon in the background.", "nvmf-rdma daemon --background"),
            (
                "Under systemd (contrib/nvmf-rdma.service): connect what discovery.conf lists.",
                "nvmf-rdma daemon --connect-all",
            ),
            ("Stop it, if no export is in use.", "nvmf-rdma daemon --stop"),
        ],
        "connect" => &[
            (
                "Connect with 2 I/O queues of 128 entries; prints the controller's name.",
                "nvmf-rdma connect -t rdma -a 192.0.2.10 -s 4420 -n nqn.2026-11.io.nvmf-rdma:demo -i 2 -Q 128",
            ),
            (
                "Export namespace 1 as an NBD unix socket.",
                "nvmf-rdma connect -a 192.0.2.10 -n nqn.2026-11.io.nvmf-rdma:demo --nbd unix:/run/nvmf0.sock",
            ),
            (
                "Retry forever, reconnecting at once.",
                "nvmf-rdma connect -a 192.0.2.10 -n nqn.2026-11.io.nvmf-rdma:demo -l -1 -c 0",
            ),
        ],
        "connect-all" => &[
            ("Everything a discovery controller lists.", "nvmf-rdma connect-all -t rdma -a 192.0.2.10"),
            ("Everything the daemon's discovery.conf lists.", "nvmf-rdma connect-all"),
        ],
        "list" => &[("As JSON.", "nvmf-rdma list -o json")],
        "list-subsys" => &[("Subsystems and their paths.", "nvmf-rdma list-subsys")],
        "disconnect" => &[
            ("By name.", "nvmf-rdma disconnect -d nvmf0"),
            (
                "By NQN, even with an export in use (its users get I/O errors).",
                "nvmf-rdma disconnect -n nqn.2026-11.io.nvmf-rdma:demo --force",
            ),
        ],
        "disconnect-all" => &[("Every controller.", "nvmf-rdma disconnect-all")],
        "man" => &[("Write the pages into /usr/local/share/man/man1.", "nvmf-rdma man --dir /usr/local/share/man/man1")],
        "completions" => &[(
            "Bash completion for this shell.",
            "source <(nvmf-rdma completions bash)",
        )],
        "read" => &[
            ("A block as a hex dump.", "nvmf-rdma read -d nvmf0 --lba 0 --size 4K --hex"),
            ("1 MiB into a file.", "nvmf-rdma read -d nvmf0 --lba 2048 --size 1M --output part.bin"),
        ],
        "write" => &[
            ("A file at block 0.", "nvmf-rdma write -d nvmf0 --lba 0 --input file.bin"),
            ("64 KiB of 0xAB.", "nvmf-rdma write -d nvmf0 --lba 8 --size 64K --pattern 171"),
        ],
        "verify" => &[("Write, read back and compare 256 MiB.", "nvmf-rdma verify -d nvmf0 --size 256M")],
        "chaos" => &[
            ("Faults on loopback for 20 s.", "nvmf-rdma chaos"),
            (
                "Host-side faults against your target, every 2 s.",
                "nvmf-rdma chaos -a 192.0.2.10 -n nqn.2026-11.io.nvmf-rdma:demo --every 2s",
            ),
        ],
        "qp-states" => &[("As a Graphviz graph.", "nvmf-rdma qp-states --dot | dot -Tsvg > qp.svg")],
        "hw" => &[("The kernel RDMA devices.", "nvmf-rdma hw list")],
        _ => &[],
    }
}

const EXIT_STATUS: &str = "\
.SH \"EXIT STATUS\"
.TP
0
Success; also when the reader of the output went away (a closed pipe).
.TP
1
Failure: one line on standard error says what failed and what to check.
.TP
2
The command line could not be parsed (clap's usage message).
";

const ENVIRONMENT: &str = "\
.SH ENVIRONMENT
.TP
NVMF_RDMA_RUN_DIR
The run directory: the daemon's control socket, its log and the foreground controllers' \
sockets. Default: $XDG_RUNTIME_DIR/nvmf\\-rdma, else /run/nvmf\\-rdma.
.TP
NVMF_RDMA_CONFIG_DIR
Where the daemon reads discovery.conf. Default: /etc/nvmf\\-rdma.
.TP
RUST_LOG
Log filter for standard error (for example RUST_LOG=debug).
.TP
NVMF_RDMA_ICRC
skip: do not check the ICRC of RoCEv2 peers (no raw socket needed).
.TP
NVMF_RDMA_LOOPBACK
udp: packets between soft\\-HCAs of one process go through UDP sockets instead of memory.
.TP
NOTIFY_SOCKET
Set by systemd: the daemon reports READY, STATUS and STOPPING there.
";

const FILES: &str = "\
.SH FILES
.TP
RUN_DIR/daemon.sock
The daemon's control socket (0600; see docs/control\\-protocol.md).
.TP
RUN_DIR/daemon.log
The log of a daemon started in the background.
.TP
/etc/nvmf\\-rdma/discovery.conf
What `connect\\-all' and `daemon \\-\\-connect\\-all' connect (nvme\\-cli's format).
.TP
/etc/nvme/hostnqn, /etc/nvme/hostid
The host NQN and host ID, as nvme\\-cli keeps them.
";

/// Roff text for one example line: backslashes and hyphens escaped, a leading dot kept
/// literal.
fn roff(s: &str) -> String {
    let t = s.replace('\\', "\\e").replace('-', "\\-");
    if t.starts_with('.') || t.starts_with('\'') {
        format!("\\&{t}")
    } else {
        t
    }
}

/// The sections to append to the page of `command`.
pub(crate) fn extra_sections(command: &str) -> String {
    let mut out = String::from(".SH EXAMPLES\n");
    for (what, line) in examples(command) {
        out += &format!(".TP\n\\fB{}\\fR\n{}\n", roff(line), roff(what));
    }
    out + EXIT_STATUS + ENVIRONMENT + FILES
}
