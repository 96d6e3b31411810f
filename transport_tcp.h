/* transport_tcp.h — distopt's collectives (dopt_comm) over TCP sockets: any machines, no MPI.
   Part of distopt 0.1.0. MIT licence (see the end of distopt.h).

   DO THIS in exactly one C or C++ file of your program, before including the headers:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_tcp.h"

   Other files include the two headers without the macro. The header uses POSIX sockets and
   clocks (Linux, the BSDs, macOS): under strict -std=c11 include it first, before distopt.h and
   any system header (it then asks for POSIX itself), or compile with -D_GNU_SOURCE; nothing
   extra to link.

   QUICK START
   Most programs do not call this header themselves: with it included before launch.h,
   dopt_comm_create_from_env(&comm) starts TCP for ranks a launcher started (srun, torchrun,
   DOPT_RANK=...; launch.h's WHICH TRANSPORT), and dopt_comm_finish(comm, status) ends every rank.
   Called directly:

       #define DISTOPT_IMPLEMENTATION
       #include "distopt.h"
       #include "transport_tcp.h"
       #include <stdio.h>
       #include <string.h>

       static void say(void *user, dopt_log_level level, const char *message) {
           (void)user;
           if (level <= DOPT_LOG_WARN) fprintf(stderr, "distopt: %s\n", message);
       }

       int main(void) {
           float grads[1000] = {0};
           dopt_tcp_config base;
           dopt_comm *comm;
           dopt_status st;
           memset(&base, 0, sizeof base);
           base.log_fn = say;    (whom the start waits for, and why it failed)
           if (dopt_tcp_create_from_env(&comm, &base) != DOPT_OK) return 1;   (DOPT_RANK, ...)
           grads[0] = (float)comm->rank;
           st = dopt_allreduce(comm, grads, 1000, DOPT_F32, DOPT_MEAN);
           return dopt_comm_finish(comm, st);   (destroys comm; a failure was told to say)
       }

   LAUNCH (one process per rank; any start order; rank 0's address and port are the meeting point)

       DOPT_WORLD_SIZE=2 DOPT_MASTER_PORT=29500 DOPT_RANK=0 ./train &
       DOPT_WORLD_SIZE=2 DOPT_MASTER_PORT=29500 DOPT_RANK=1 ./train

   Across machines, give every rank DOPT_MASTER_ADDR=<rank 0's address>; each rank listens for
   its peers on the address of the interface that reached rank 0, or on the interface that
   DOPT_SOCKET_IFNAME names (DOPT_SOCKET_IFNAME=eth0), or on DOPT_BIND_ADDR.

   CONFIGURATION (dopt_tcp_config; zero means the default)

   | field                 | meaning                                                   | zero means         |
   |-----------------------|-----------------------------------------------------------|--------------------|
   | rank, world_size      | this process's rank in [0, world_size); world_size >= 1   | (required)         |
   | master_addr           | rank 0's host name, IPv4 or IPv6 address, optionally with | master_host, else  |
   |                       | its port: "node7:29500", "[fd00::1]:29500" (ADDRESSES)    | "127.0.0.1"        |
   | master_host           | (a char array) rank 0's host as dopt_tcp_config_from_env  | none               |
   |                       | found it; used when master_addr is NULL                   |                    |
   | master_port           | rank 0's rendezvous port. On rank 0, 0 lets the kernel    | rank 0: any free   |
   |                       | pick a free port, reported through on_listen; the other   | port; others: an   |
   |                       | ranks must be given the real port (here or in master_addr)| error              |
   | bind_addr             | where this rank listens (rank 0: for everyone; others:    | rank 0: master_addr|
   |                       | for the ranks above it): name, IPv4 or IPv6 address.      | others: the local  |
   |                       | "0.0.0.0" or "::" listens on every address of its family  | address toward 0;  |
   |                       |                                                           | socket_ifname's if |
   |                       |                                                           | set (INTERFACES)   |
   | socket_ifname         | the interface(s) to take this rank's address from:        | as bind_addr says  |
   |                       | "eth" (prefixes), "=eth1" (exact), "^lo,docker" (all but) |                    |
   |                       | (INTERFACES); bind_addr, when set, wins                   |                    |
   | timeout_ms            | bound on every wait of a collective: it fails when        | 300000 (300 s)     |
   |                       | nothing moved for this long                               |                    |
   | rendezvous_timeout_ms | bound on the whole rendezvous (create), the retries to    | 600000 (10 min)    |
   |                       | reach rank 0 included; see STARTING UP                    |                    |
   | rendezvous_report_ms  | while the rendezvous waits, say this often whom it waits  | 5000; negative:    |
   |                       | for (DOPT_LOG_WARN)                                       | never              |
   | token                 | job token, at most DOPT_TCP_TOKEN_MAX (64) bytes; every   | "" (no token)      |
   |                       | connection must present the same one                      |                    |
   | socket_buffer_bytes   | SO_SNDBUF/SO_RCVBUF (capped by net.core.[rw]mem_max)      | kernel autotuning  |
   | small_bytes           | latency-optimal algorithms up to this many bytes (see     | 65536              |
   |                       | ALGORITHMS)                                               |                    |
   | spin_us               | after progress, poll without sleeping this long before a  | 50; negative: never|
   |                       | blocking poll()                                           | spin               |
   | progress_thread_us    | > 0: a thread moves requests in flight (dopt_allreduce_   | 0: none (requests  |
   |                       | start...) every this many µs while the caller computes;   | move inside test,  |
   |                       | distopt.h's dopt_comm_set_progress_thread                 | wait)              |
   | two_level             | the host-aware allreduce (ALGORITHMS) when ranks share    | DOPT_TWO_LEVEL_AUTO|
   |                       | hosts: DOPT_TWO_LEVEL_AUTO on the ring path, _ON for every|                    |
   |                       | allreduce, _OFF never                                     |                    |
   | on_peer_lost          | DOPT_FAIL: a lost rank ends the job (every survivor names | DOPT_FAIL          |
   |                       | it); DOPT_SHRINK: the survivors may go on without it      |                    |
   |                       | (dopt_comm_shrink; SURVIVING A LOST RANK)                 |                    |
   | min_ranks             | with DOPT_SHRINK, fewer survivors than this end the job   | 0: any number      |
   |                       | with DOPT_ERR_PEER_LOST on every survivor                 |                    |
   | keepalive_s           | seconds a link may be idle before the kernel probes the   | 1 (a silent host is|
   |                       | peer's host, and between probes; 3 unanswered end the     | named within about |
   |                       | link (KEEP-ALIVE)                                         | 4 s); <0: off      |
   | dead_after_ms         | > 0: heartbeats over UDP every tenth of it; a peer not    | 0: off (keep-alive |
   |                       | heard from this long has its link ended, so a stopped     | only); >= 100      |
   |                       | process or a silent host is named in about this time, even|                    |
   |                       | between collectives (HEARTBEAT)                           |                    |
   | join                  | 1: this process asks a running DOPT_SHRINK job to take it | 0                  |
   |                       | back (TAKING A WORKER BACK); rank, world_size are ignored |                    |
   | join_peers            | with join, members to ask after rank 0 (master_addr,      | none: rank 0 only  |
   |                       | master_port): "host:port,host:port"                       |                    |
   | listen_port           | ranks > 0 and joiners: the port this process listens on   | 0: a free port the |
   |                       | for the other ranks' links, shrinks and joiners; a fixed  | kernel picks       |
   |                       | one lets a restarted worker be told where the members are |                    |
   |                       | (join_peers) when rank 0 is gone                          |                    |
   | log_fn, log_user      | logging callback, installed on the communicator. It also  | silent             |
   |                       | hears the rendezvous (whom it waits for, joiners refused) |                    |
   |                       | and is how a failed create tells why (there is no         |                    |
   |                       | communicator to ask then): exactly one DOPT_LOG_ERROR line|                    |
   | on_listen,            | rank 0 only: on_listen(on_listen_user, port) once the     | not called         |
   | on_listen_user        | rendezvous port listens, before waiting for the others    |                    |

   ENVIRONMENT (dopt_tcp_config_from_env, dopt_tcp_create_from_env)

   | variable                   | field                 | required                           |
   |----------------------------|-----------------------|------------------------------------|
   | DOPT_RANK                  | rank                  | yes, or a launcher's (below)       |
   | DOPT_WORLD_SIZE            | world_size            | yes, or a launcher's (below)       |
   | DOPT_MASTER_ADDR           | master_host           | no (127.0.0.1); may carry the port |
   | DOPT_MASTER_PORT           | master_port           | yes when the world is > 1 (on rank |
   |                            |                       | 0, unless the config has on_listen)|
   |                            |                       | and DOPT_MASTER_ADDR has no port   |
   | DOPT_TIMEOUT_MS            | timeout_ms            | no (the config's, else 300000)     |
   | DOPT_RENDEZVOUS_TIMEOUT_MS | rendezvous_timeout_ms | no (the config's, else 600000)     |
   | DOPT_TOKEN                 | token                 | no ("")                            |
   | DOPT_BIND_ADDR             | bind_addr             | no                                 |
   | DOPT_SOCKET_IFNAME         | socket_ifname         | no                                 |
   | DOPT_TWO_LEVEL             | two_level             | no ("auto", "on" or "off")         |
   | DOPT_PROGRESS_THREAD_US    | progress_thread_us    | no (the config's, else 0: none)    |
   | DOPT_ON_PEER_LOST          | on_peer_lost          | no ("fail" or "shrink"; the        |
   |                            |                       | config's, else fail)               |
   | DOPT_MIN_RANKS             | min_ranks             | no (the config's, else 0)          |
   | DOPT_KEEPALIVE_S           | keepalive_s           | no (the config's, else 1; -1: off) |
   | DOPT_DEAD_AFTER_MS         | dead_after_ms         | no (the config's, else 0: off)     |
   | DOPT_JOIN                  | join                  | no (0 or 1; with 1, DOPT_RANK and  |
   |                            |                       | DOPT_WORLD_SIZE are not needed)    |
   | DOPT_JOIN_PEERS            | join_peers            | no                                 |
   | DOPT_LISTEN_PORT           | listen_port           | no (0 to 65535; the config's, else |
   |                            |                       | 0: any)                            |

   Rank, world size and rank 0's address and port are read by distopt.h's dopt_launch_read (its
   LAUNCH VARIABLES): besides DOPT_*, from mpirun's (OMPI_COMM_WORLD_*, PMI_*), srun's
   (SLURM_PROCID, SLURM_NTASKS, the step's first node, a port derived from the job's id) or
   torchrun's (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) variables. An address the environment
   gives is written to master_host (master_addr is set to NULL; dopt_tcp_create uses master_host
   when master_addr is NULL). When the launcher puts only some ranks on this host and nothing
   names rank 0's host, that is an error rather than a guess.
   The variables that describe the job (rank, world size, where rank 0 is, the token, where to
   listen, on which interface) come from the environment alone, unset ones meaning the default;
   the timeouts, DOPT_TWO_LEVEL, DOPT_PROGRESS_THREAD_US, DOPT_ON_PEER_LOST, DOPT_MIN_RANKS,
   DOPT_KEEPALIVE_S and DOPT_DEAD_AFTER_MS only when set. Every other field is
   the caller's. A value that does not fit is refused with one DOPT_LOG_ERROR line through the
   config's log_fn naming the variable, its value and the rule:
       DOPT_WORLD_SIZE="abc" is not a number
       DOPT_RANK=2 is not below DOPT_WORLD_SIZE=2
       DOPT_RANK is not set (every rank needs it; or start the job with a launcher that sets it:
       mpirun, srun, torchrun)
       DOPT_MASTER_PORT is not set: rank 1 needs rank 0's port
       DOPT_MASTER_PORT=70000 is above 65535
       DOPT_MASTER_ADDR="[fd00::1]:29500" names port 29500 but DOPT_MASTER_PORT=29501
       DOPT_TOKEN is 70 bytes long, more than 64
       rank 0's address is unknown: Open MPI's variables put 2 of the 8 ranks on this host and
       none names rank 0's host; set DOPT_MASTER_ADDR to it (mpirun: -x DOPT_MASTER_ADDR=<host>)

   ADDRESSES

   IPv4 and IPv6 alike. master_addr (DOPT_MASTER_ADDR) is a host name, an IPv4 or an IPv6
   address, optionally with rank 0's port attached: "node7", "node7:29500", "10.0.0.1",
   "10.0.0.1:29500", "fd00::1", "[fd00::1]", "[fd00::1]:29500" (an IPv6 address without
   brackets has no port). An attached port stands for master_port; both set and different is an
   error naming both. bind_addr (DOPT_BIND_ADDR) takes the same forms without a port; "0.0.0.0"
   and "::" listen on every address of that family (the others then reach the rank at the
   address its connection to rank 0 came from). A name is resolved with getaddrinfo, either
   family, and its first address is used, in the order the resolver gives (RFC 6724's, which
   puts destinations this host cannot reach last; /etc/gai.conf changes it); write an address to
   choose another. Link-local IPv6 addresses (fe80::/10) are refused: they need an interface
   scope the other ranks cannot be told. Each socket is made of its address's family (AF_INET or
   AF_INET6, never a dual-stack socket), so an IPv4 job runs on hosts booted with IPv6 disabled.
   Messages print addresses as 10.0.0.1:29500 or [fd00::1]:29500.

   INTERFACES

   socket_ifname (DOPT_SOCKET_IFNAME) chooses the network interface whose address a rank listens
   on and is reached at, with NCCL_SOCKET_IFNAME's rule: a comma-separated list of interface
   name prefixes ("eth" is eth0, eth1, ...; "eth,ib"), exact names after a leading "="
   ("=eth1"), every interface but those after a leading "^" ("^lo,docker"; "^=" for exact
   names). Of the interfaces it matches, the first in the system's order (getifaddrs'; on Linux
   `ip link`'s) that is up with an IPv4 or IPv6 address (link-local IPv6 aside) is chosen. On
   an interface with both, its IPv4 address is chosen unless the master address is IPv6 (then
   its IPv6 one): the job keeps to one family where it can. Where each rank listens:
   - rank 0: bind_addr if set; else master_addr if set (every address of its family when it is
     a name this host resolves to loopback: LOOPBACK); else socket_ifname's address if set
     (IPv4 first); else 127.0.0.1. Listening everywhere (a wildcard bind_addr, "0.0.0.0" or
     "::", or that name), it is told to the others as socket_ifname's address if set, else as
     master_addr.
   - the others: bind_addr if set; else socket_ifname's address if set; else the local address
     of their connection to rank 0 (the interface that reached it).
   So bind_addr, set explicitly, wins over socket_ifname. A socket_ifname that matches no such
   interface is DOPT_ERR_INVALID naming the interfaces there are and their addresses:
       rank 1: setup: socket_ifname "=eth9" matches no interface that is up with an IPv4 or
         IPv6 address; this host has lo 127.0.0.1 ::1, eth0 10.0.0.2 fd00::2, docker0 (down)

   LOOPBACK: NEVER TOLD TO ANOTHER HOST

   A loopback address (127.0.0.0/8, ::1) is, on every host, that host: a rank of another host
   told to connect to one would connect to itself and wait. The rule, which never lets a job
   wait for the rendezvous timeout because of it:
   - A rank other than 0 that reaches rank 0 at an address that is not loopback (so ranks may
     run on other hosts) refuses to be reached at a loopback address, before it connects:
         rank 1: setup: this rank would be reached at 127.0.0.1 (socket_ifname "lo": interface
           lo): a loopback address, where other hosts cannot reach it, and it reaches rank 0 at
           10.0.0.1:29500, which is not one (ranks may run on other hosts); give it an address
           other hosts reach: DOPT_SOCKET_IFNAME=<interface> or DOPT_BIND_ADDR=<address> (or,
           when every rank runs on this host, DOPT_MASTER_ADDR=127.0.0.1)
   - Rank 0, once every rank joined, takes the job to run on its host when every connection
     came from a loopback address, and then loopback addresses serve. When one came from
     another address (another host, as far as rank 0 can tell, even when it is this one), no
     rank may be reached at a loopback address, rank 0 included: its own is the address it is
     told at (INTERFACES), so a rank 0 with bind_addr "0.0.0.0" and no master_addr (127.0.0.1)
     is refused. If one would be, rank 0 refuses the job: every rank fails at once with
     DOPT_ERR_INVALID naming that rank and address:
         rank 0: setup: rank 1 would be reached at 127.0.0.1:41000 (it joined from
           127.0.0.1:52114): a loopback address, where other hosts cannot reach it, and rank 2
           joined from 10.0.0.3:40222, which is not one (another host, as far as rank 0 can
           tell); give it an address other hosts reach: DOPT_MASTER_ADDR=<rank 0's address as
           other hosts reach it>, DOPT_SOCKET_IFNAME=<interface> or DOPT_BIND_ADDR=<address>
         rank 2: setup: rank 0 at 10.0.0.1:29500 refused the job: rank 1 would be reached at
           127.0.0.1:41000, a loopback address, and ranks joined from other hosts, ...
   - A master_addr that is a name (not an address, not localhost) that rank 0's host resolves
     to a loopback address, the /etc/hosts line "127.0.1.1 node7" of many distributions while
     the other hosts resolve node7 to its real address, makes rank 0 listen on every address of
     that family: the ranks of other hosts reach it and are refused at once as above ("rank 0
     would be reached at 127.0.1.1:29500 (master_addr "node7", which this host resolves to
     127.0.1.1)"), instead of retrying a port nobody listens on. With socket_ifname set, rank 0
     is told at that interface's address instead, and the job runs.
   Not caught: a rank 0 given a loopback address as such (master_addr 127.0.0.1, or unset, with
   no bind_addr) listens there only, so ranks of other hosts, told its real address, cannot
   connect at all: they say so ("Connection refused") every report until the rendezvous timeout.

   FUNCTIONS

   dopt_tcp_create(&comm, &cfg) joins the world described by cfg and returns when every rank is
     connected to every other: rank 0 listens on master_addr:master_port (ADDRESSES, INTERFACES,
     LOOPBACK); the other ranks connect to it (retrying with backoff while it is not up yet),
     present their rank, world size and token, and receive from rank 0 the table of everyone's
     listening address; each rank then connects to the ranks below it and accepts the ranks above
     it, and rank 0 lets all go once all report ready (the records they exchange: REFERENCE FOR
     CONTRIBUTORS below, WIRE FORMAT). All of it within cfg->rendezvous_timeout_ms,
     saying whom it waits for (STARTING UP). A joiner that dies before the job forms does not end
     it: rank 0 frees its rank, or, once the table has gone out, has every rank start the
     rendezvous over, and waits for the real one. Rank 0 keeps listening for the communicator's
     life, so that a late joiner (a second process given a rank already taken) is refused at once,
     during rank 0's collectives, instead of finding nobody there. On success *comm is a
     communicator of cfg->world_size ranks (a world of 1 opens no socket) that knows how many ranks
     share this rank's rendezvous address (dopt_comm_set_host, with the cores online); end it
     with dopt_comm_finish (or dopt_comm_destroy). On failure *comm is NULL, every socket is
     closed, and the reason went to cfg->log_fn in exactly one DOPT_LOG_ERROR line. cfg and its
     strings are read during the call only.
   dopt_tcp_config_from_env(&cfg) sets cfg's fields from the environment (ENVIRONMENT above;
     the strings point into it) and keeps the others, log_fn and log_user included, as the
     caller set them: zero cfg first, or start from a config of your own. A port attached to
     DOPT_MASTER_ADDR sets master_port (master_addr keeps the whole text). DOPT_ERR_INVALID, said
     through cfg->log_fn, when a required variable is missing, a number is malformed or out of
     range, the rank is not below the world size, DOPT_MASTER_ADDR does not parse or its port
     differs from DOPT_MASTER_PORT, or the token is too long; cfg is then left as it was.
   dopt_tcp_create_from_env(&comm, base) is the two above in one call, starting from *base (NULL:
     a zero config): what the environment does not set (log_fn, log_user, on_listen, spin_us,
     socket_buffer_bytes, small_bytes, a timeout whose variable is unset) is base's.
   dopt_tcp_create_from_sockets(&comm, fds, &cfg) makes a communicator over connected stream
     sockets the caller already has (its own launcher, socketpair() between forked processes):
     fds[r] talks to rank r (fds[cfg->rank] is ignored). Both ends of every connection must be
     made by this function on their side; no handshake is done and the addresses, port and token
     of cfg are not used. The communicator takes the sockets, also when it fails (they are
     closed). DOPT_ERR_INVALID for a negative descriptor.

   The collectives are distopt.h's (dopt_allreduce, dopt_allgather(v), dopt_broadcast,
   dopt_barrier). A communicator is used by one thread at a time; different communicators are
   independent. No signal handler is installed: every send uses MSG_NOSIGNAL, so a dead peer
   cannot kill the process with SIGPIPE.

   STARTING UP: WHAT THE LOG SAYS

   While the rendezvous waits, every rendezvous_report_ms (5 s) each rank says whom it waits
   for, at DOPT_LOG_WARN:
       rank 0: waiting for ranks 1, 3 (2 of 4 joined, 12 s)
       rank 1: waiting for rank 0 at 10.0.0.1:29500 (Connection refused, 5 s)
       rank 1: waiting for the other ranks to join rank 0 at 10.0.0.1:29500 (10 s)
       rank 2: waiting for rank 3 to connect (5 s)
   WARN, not INFO: a rank still missing after seconds is how a launch gone wrong first shows (a
   rank not started, a wrong port or address), so callbacks that show only warnings (the
   examples' does) must show it; a healthy start is over before the first report and logs
   nothing at WARN. Once the job formed, each rank says how at DOPT_LOG_INFO (launch.h's
   default logger shows it with DOPT_LOG_LEVEL=info): where it met rank 0, and the hosts as
   the ranks' rendezvous addresses tell them (in the order of their lowest rank):
       tcp rank 1 of 4: rendezvous at 10.0.0.1:29500, 2 hosts (ranks per host 2,2)
       tcp rank 0 of 1: a world of one, no sockets
   A rank that refuses a joiner says so at once (WARN), naming it, and keeps waiting for the real
   rank; the joiner's create fails with the reason:
       rank 0: refused a joiner from 127.0.0.1:41234 claiming rank 1: token differs
       rank 0: refused a joiner from 127.0.0.1:41240 claiming rank 1: its world size is 3, this
         job's 2
       rank 0: refused a joiner from 127.0.0.1:41250 claiming rank 1: rank 1 is already taken by
         127.0.0.1:41230
       rank 1: setup: rank 1 is already taken by 127.0.0.1:41230 (rank 0 at 127.0.0.1:29500
         refused this process)
   A joiner that dies before the job forms (WARN):
       rank 0: rank 1 (from 127.0.0.1:41234) closed its connection before the job formed;
         starting the rendezvous over
       rank 2: rank 0 started the rendezvous over (a rank left before the job formed); joining
         again
   The rendezvous is bounded by rendezvous_timeout_ms, 10 min unless set, twice the collective
   timeout: ranks of one job may start minutes apart (nodes that come up late, containers being
   pulled, data loaded before the create), and the wait is not silent (the reports above), so
   a long bound costs only time the reports account for. The timeout names the missing ranks and
   the last joiner refused:
       rank 0: setup: timed out after 600000 ms waiting for rank 1 (1 of 2 joined); refused a
         joiner from 127.0.0.1:41234 claiming rank 1: token differs

   ERRORS

   From create (the detail, "rank R: setup: ...", goes to cfg->log_fn, once):
     DOPT_ERR_INVALID    a bad configuration ("tcp: invalid configuration: rank 2 is outside
                         0..1", no master_port on a rank other than 0, token too long, an
                         address that does not parse or resolve, "master_addr \"[::1]:29500\"
                         names port 29500 but master_port is 29501", a socket_ifname that
                         matches no interface (naming those there are: INTERFACES), a loopback
                         address that other hosts would be told (LOOPBACK), or the
                         environment: ENVIRONMENT), or rank 0 refused this rank: "rank 1 is
                         already taken by 127.0.0.1:41230", it does not admit that rank, or the
                         world sizes differ.
     DOPT_ERR_AUTH       rank 0 (or a peer) refused this rank's token, or a peer answered with
                         a different token: this process is not part of that job.
     DOPT_ERR_TIMEOUT    not everyone arrived within rendezvous_timeout_ms (rank 0 names the
                         missing ranks), or rank 0 was never reachable ("could not connect to
                         rank 0 at 127.0.0.1:29500 within 600000 ms (1206 tries): Connection
                         refused").
     DOPT_ERR_PEER_LOST  rank 0 failed during the rendezvous (it then closes every connection,
                         so every rank stops at once instead of at its bound), or a connection
                         to another rank ended and rank 0 did not start over within 2 s.
     DOPT_ERR_PROTOCOL   a peer spoke another protocol version ("rank 0 at 10.0.0.1:29500
                         speaks protocol version 2, this rank version 3 (another release of
                         distopt: give every rank the same one)") or sent malformed records.
     DOPT_ERR_IO         a socket call failed: "cannot listen on 127.0.0.1:29500: Address
                         already in use".
     DOPT_ERR_NOMEM      an allocation failed.
   Strangers never fail the job: a connection to rank 0 (or to any listening rank) that sends
   bytes other than a valid HELLO, a wrong token, a wrong world size, a rank already taken, or
   nothing at all is refused and closed, logged at DOPT_LOG_WARN, and the rendezvous goes on.
   Rank 0 holds up to 32 silent connections at once (the oldest is dropped first).

   From a collective (the detail names this rank, the collective and its sequence number, and
   the peer; the communicator is then poisoned and later calls return the same status at once):
     DOPT_ERR_MISMATCH   a peer's frame belongs to another collective, sequence number, dtype,
                         op, root or count: "rank 1: allreduce #7 (f32 sum, 16 elems): rank 2
                         called allreduce #7 (f32 sum, 17 elems)". Checked before any payload.
     DOPT_ERR_PEER_LOST  a peer closed its connection or its process died ("rank 2 closed the
                         connection", "connection to rank 2 lost while sending: Broken pipe"),
                         or destroyed its communicator while this rank still needed data from
                         it.
     DOPT_ERR_TIMEOUT    nothing moved for timeout_ms: "no progress for 2000 ms waiting for
                         data from rank 3". The clock restarts with every byte that moves, so a
                         long transfer is never cut while it progresses.
     DOPT_ERR_PROTOCOL   a peer sent bytes that are not a frame of this protocol, a frame larger
                         (or smaller) than the buffer this rank posted for it, or a frame from
                         a peer this collective expects nothing from. Nothing is ever written
                         beyond a posted buffer.
     DOPT_ERR_IO, DOPT_ERR_NOMEM as above.
   Any status a peer failed with reaches this rank too: see the next section.

   WHAT EVERY RANK SEES WHEN ONE FAILS

   Every survivor's detail names the rank whose failure it is (the culprit) first, and who saw
   it when that was another rank: "rank 0: allreduce #16 (f32 sum, 16777216 elems): rank 1
   closed the connection (reported by rank 2)". A mismatch's words carry both
   calls: "rank 2 called allreduce #7 (f32 sum, 17 elems) and rank 1 allreduce #7 (f32 sum,
   16 elems) (reported by rank 1)". A connection that ends mid-frame may name two ranks ("rank 1
   closed the connection; rank 2's is closed too"). How the failure travels between the ranks
   (ABORT frames, which rank is blamed for a connection that ends): see REFERENCE FOR
   CONTRIBUTORS below.
   Every rank watches every connection during every collective, so:
   - a mismatch gives DOPT_ERR_MISMATCH on every rank, each detail naming both calls;
   - a killed peer gives DOPT_ERR_PEER_LOST on every survivor, naming the dead rank, typically
     within milliseconds;
   - a stuck (live but silent) peer gives DOPT_ERR_TIMEOUT after timeout_ms on the ranks
     waiting for it, and the others get their abort at once, naming it.
   A rank whose part of a collective was already complete when the error happened (the root of
   a broadcast, or a rank that had everything it needed) returns DOPT_OK and fails at its next
   collective with the peer's status. dopt_comm_destroy says goodbye to every peer (waiting at
   most min(timeout_ms, 5 s) for room in a full send buffer), so a rank that leaves right after
   the last collective never fails a peer still finishing it; a peer that closes without a
   goodbye fails only the ranks that still need data from it.

   KEEP-ALIVE (keepalive_s, DOPT_KEEPALIVE_S)

   A killed process's kernel closes its connections, and every survivor hears it at once. A
   host that dies, loses power or is cut off says nothing: without more, the ranks waiting for
   it would wait timeout_ms (5 minutes by default), and ranks between collectives would not know.
   So every link asks the kernel for keep-alive: once a link has been idle keepalive_s seconds
   (default 1) the kernel sends the peer's host a probe, then one every keepalive_s; 3 without
   an answer end the connection. A silent host is then known within about 4 x keepalive_s:
   a collective started later fails at once with DOPT_ERR_PEER_LOST naming it, and one waiting
   for it fails then and tells the others
   (measured on the simulated cluster by tests/check_keepalive.sh, a host cut off and its rank
   killed: the survivors' next allreduce after 6 s of idleness failed within 4 ms, naming the
   host's rank ("connection to rank 2 lost while sending: Connection timed out"); in an
   allreduce already waiting for it, the rank idle toward it failed 4.0 s after the cut and the
   other, told by its abort, 4.0-5.0 s after (up to 1 s more when its own send to the silent
   host held back what it read); keep-alive off, they waited for timeout_ms).
   Cost while idle: one 52-byte probe and its answer per link and keepalive_s, sent by the
   kernel; nothing runs in the process. Limits: the kernel of a live host answers for its
   processes, so a process that is stopped or stuck but not dead is not seen by keep-alive (the
   collective's timeout names it, DOPT_ERR_TIMEOUT); and a link that has data of its own
   waiting for an answer is not idle: it is bound by timeout_ms, unless another survivor, idle
   toward the silent host, ends the collective first (a ring's next rank does). The kernel
   counts in whole seconds, and a link is ended by 3 lost probes rather than 1 so that a lossy
   network does not end idle links (at 1% loss, a probe or its answer is lost 2% of the time:
   three in a row, 8 in a million idle seconds per link): about 4 s is the floor here. The old
   links ending is also what dopt_comm_shrink waits for before it leaves out a silent rank.

   HEARTBEAT (dead_after_ms, DOPT_DEAD_AFTER_MS)

   To know sooner, and to see a process that is stopped or stuck on a live host, set
   dead_after_ms (1000 is a good start on a LAN; keep it above several round trips of the slowest
   link and above the longest stall a host may take, a swap storm or a debugger's pause). Each
   rank then runs a thread that sends every peer a 48-byte UDP datagram every dead_after_ms / 10
   (from and to the port it listens on: open that UDP port where TCP's is open), and ends the
   link to a peer it has not heard from for dead_after_ms, logging why:
       rank 0: rank 2 not heard from for 1000 ms (dead_after_ms 1000): its host is down or cut
       off, or its process is stopped; its link is ended, so collectives fail with
       DOPT_ERR_PEER_LOST naming it ("Connection timed out")
   A collective waiting for that peer fails then, one started later fails at its start, and
   dopt_comm_shrink leaves the peer out. The thread runs beside the training, not in it: a rank
   busy computing for minutes keeps sending. It goes on across dopt_comm_shrink and
   dopt_comm_grow (the newest communicator holds it). A datagram carries a keyed hash of the
   token (not the token) and a sequence number: strangers' and replayed ones are dropped.
   Measured on the simulated cluster (tests/check_keepalive.sh, dead_after_ms 1000, a host cut
   off and its rank killed): both survivors gave up on it 909-916 ms after the cut, idle or in a
   1 MiB allreduce, which then failed at once (keep-alive alone: 4.0 s). Cost while idle (4 ranks
   on loopback, 20 s idle, processor time against dead_after_ms 0): about 1 ms per rank and
   second at dead_after_ms 1000, 11 ms at 100; on the wire, 76 bytes per peer and tenth of
   dead_after_ms. Off by default: a job that fails on
   any lost rank (DOPT_FAIL) would end for a stall it could have waited out. A rank that cannot
   bind its UDP port says so, still sends, and notices a silent peer by keep-alive only.
   Communicators made from sockets (dopt_tcp_create_from_sockets) have no addresses: no heartbeat.

   SURVIVING A LOST RANK (on_peer_lost = DOPT_SHRINK; distopt.h: SURVIVING A LOST PEER)

       // after a collective failed with DOPT_ERR_PEER_LOST (or TIMEOUT), on every survivor:
       dopt_comm *next;
       if (dopt_comm_shrink(comm, &next) != DOPT_OK) return dopt_comm_finish(comm, 1);
       dopt_comm_destroy(comm);
       comm = next; // the survivors, renumbered in their old order; next->epoch counts shrinks

   With DOPT_SHRINK every rank but 0 keeps the socket it listened on at the rendezvous, and an
   abort leaves the links open (without DOPT_SHRINK it shuts them for writing): a link's end
   then means its process died or left. dopt_comm_shrink runs the survivors' agreement (engine.h:
   SHRINK: THE SURVIVORS' AGREEMENT): each survivor connects to the listening socket of every
   rank above it, proves it belongs to the job (a hash keyed by the token, never the token
   itself), and ranks decide in turn, each telling the ranks above it; a rank below that does
   not connect is waited for until its old link ends (plus 200 ms for its connection to
   arrive) or for timeout_ms of silence. Those connections are the next communicator's links:
   no new rendezvous, rank 0's address is not needed (rank 0 may be the one lost). Measured on
   loopback: 4 → 3 ranks in about a millisecond once the failure is known (tests/test_shrink.c
   prints it). A rank that dies during the agreement is left out, or, when it dies after the
   decision, named by the next communicator's first collective (shrink again). The settings
   carry over (timeout, token, socket buffers, two_level, the progress thread, min_ranks); the
   hosts are recomputed from the survivors. Connections to the listening socket that are not
   survivors of this communicator (strangers, another job, a wrong token, garbage, an old
   epoch) are closed and logged; at most 32 wait at once, the oldest dropped. Limits: a rank
   that is alive but silent for timeout_ms is taken for lost and, if the others decide
   without it, its own shrink returns DOPT_ERR_PEER_LOST saying it was left out. A timeout
   names the first rank the timed-out one waits for, which may be alive and itself waiting for
   the stuck rank (a rank a collective ahead times out before the others): the ranks that
   timed out first then leave it out, and it may go on alone or with others, a second job.
   Set min_ranks above half the world so that at most one part can go on; a link that ends
   (a dead process, or a silent host through KEEP-ALIVE) names the right rank. The hello's
   proof is a 64-bit keyed hash, not a cryptographic MAC (SECURITY). After a successful shrink
   the old communicator's destroy closes its sockets at once (nobody reads them any more).

   TAKING A WORKER BACK (join; distopt.h: TAKING A WORKER BACK)

       // the restarted process: same token, DOPT_JOIN=1 (or cfg.join = 1), rank 0's address
       // and port, and DOPT_JOIN_PEERS="host:port,..." for other members (rank 0 may be gone)
       dopt_tcp_create_from_env(&comm, NULL); // returns once the members took it in
       // every member, at a moment all of them reach (a round boundary):
       dopt_comm *next;
       if (dopt_comm_grow(comm, &next) == DOPT_OK && next) { dopt_comm_destroy(comm); comm = next; }

   The joiner listens on a port of its own, then asks the members in turn, rank 0's address
   first: each member of a DOPT_SHRINK job listens (rank 0 on the master port, the others at
   their address in the peer table, which every member knows) and answers inside its
   collectives' waits, never blocking on it. Member and joiner prove to each other that they
   hold the token without sending it (a challenge-response with fresh nonces and SipHash-2-4:
   WIRE FORMAT), and the member holds the joiner (at most 4 at once; a handshake must end within
   10 s). A member that refuses the token ends the asking with DOPT_ERR_AUTH; one that is busy,
   unreachable or not formed yet sends the joiner to the next, then round again (100 ms doubling
   to 1 s) until rendezvous_timeout_ms. Held, the joiner waits for the members' dopt_comm_grow
   until the same deadline, and asks again if its member goes. dopt_comm_grow: the members
   allgather the joiners they hold, each sends its joiners their rank and every rank's address,
   and every rank connects to every rank above it, as a shrink does (fresh links: a member still
   finishing the allgather never reads a frame of the grown communicator on an old one), with a
   hello whose proof is keyed by the token and, towards a joiner, bound to that joiner's nonce. A
   barrier on the grown communicator ends it on every rank, joiners included. The grown
   communicator keeps the members' settings; its epoch is one more. A joiner lost in between (it
   died, or cannot be reached where it listens) makes that barrier fail with
   DOPT_ERR_PEER_LOST on every rank: dopt_comm_shrink then leaves it out, and the job is as it
   was. Hellos of that shrink that reach a rank still growing are kept for it. What a joiner
   needs besides links — the model and the driver's state — is the driver's to send
   (localsgd.h: ELASTIC, taking a worker back).

   When rank 0 may be the one that died, the restarted process must be told where other members
   listen. The ranks > 0 listen on a port the kernel picks unless listen_port (DOPT_LISTEN_PORT)
   fixes it: start every rank with a known one (a different one per rank on one host) and give
   the restarted process DOPT_JOIN_PEERS="host1:port1,host2:port2,...". It asks rank 0's address
   first, finds nobody there and goes on down the list; it listens on its own listen_port, so it
   can be found the same way after it joined. tests/elastic_trials.c restarts a killed rank 0 so.

   ALGORITHMS (every rank ends with the same bytes, run after run)

   The collectives, their requests (dopt_allreduce_start and friends) and the failure handling
   above are distopt.h's engine running over this transport's connections; this header is the
   connections and the rendezvous. Messages up to small_bytes take latency-optimal algorithms
   (direct exchange, a tree), larger ones pipelined rings (or a chain, for broadcast). With
   ranks on more than one host, the same number on each, a large allreduce runs in two levels
   (two_level): a host's link then carries 2·(H−1)/H of the buffer for H hosts, against the flat
   ring's 2·(N−1)/N. Which algorithm runs when: see REFERENCE FOR CONTRIBUTORS below (ALGORITHMS).
   Any world size, powers of two or not. Sizes are size_t/uint64 throughout; nothing is limited
   to int. Each rank keeps a 256 KiB receive stage per peer plus, for the small allreduce,
   (size-1) x the message of scratch grown once and reused.

   WAITING

   After each step that moved bytes a rank keeps polling (poll() with a zero timeout and
   sched_yield() in between) for spin_us; after that it sleeps in poll() until something
   happens or the timeout (measured costs: REFERENCE FOR CONTRIBUTORS below, WAITING).

   SECURITY

   The token keeps jobs apart (another job on the same port, a stale process, a port scanner);
   it is sent in clear text at the rendezvous and traffic is not encrypted. Run jobs on
   networks you trust. The survivors' agreement sends a keyed hash of the token instead of the
   token; it keeps strangers and other jobs out, but a 64-bit non-cryptographic hash seen on
   the wire could be used to guess a short token offline.
*/
#ifndef DISTOPT_TRANSPORT_TCP_H
#define DISTOPT_TRANSPORT_TCP_H

#define DOPT__WANT_POSIX 1 /* see the top of distopt.h */
#include "distopt.h"
#include "engine.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DOPT_TCP_PROTOCOL_VERSION 3
#define DOPT_TCP_TOKEN_MAX 64 /* bytes of a job token */

typedef struct dopt_tcp_config {
    int rank;                  /* this process's rank, 0 .. world_size - 1 */
    int world_size;            /* number of ranks, >= 1 */
    const char *master_addr;   /* rank 0's host name, IPv4 or IPv6 address, optionally with its port
                                  ("host:29500", "[fd00::1]:29500"); NULL: "127.0.0.1" */
    int master_port;           /* rank 0's rendezvous port; 0 on rank 0: any free port (on_listen) */
    const char *bind_addr;     /* where this rank listens (a name, IPv4 or IPv6 address); NULL: rank 0
                                  master_addr, others the local address of their connection to rank 0 */
    const char *socket_ifname; /* the interface whose address this rank listens on and is reached at:
                                  "eth" (prefixes), "=eth1" (names), "^lo,docker" (all but); NULL: as
                                  bind_addr says (INTERFACES) */
    int timeout_ms;            /* bound on every wait of a collective (the rendezvous has its own); 0: 300000 */
    const char *token;         /* job token, at most DOPT_TCP_TOKEN_MAX bytes; NULL: "" */
    int socket_buffer_bytes;   /* SO_SNDBUF and SO_RCVBUF; 0: the kernel's autotuning */
    size_t small_bytes;        /* latency-optimal algorithms up to this many bytes; 0: 65536 */
    int spin_us;               /* poll without sleeping this long after progress; 0: 50; <0: never */
    int two_level;             /* host-aware allreduce: DOPT_TWO_LEVEL_AUTO (0), _ON or _OFF */
    int progress_thread_us;    /* > 0: a progress thread passing over the links this often while
                                  requests are in flight (dopt_comm_set_progress_thread); 0: none */
    int rendezvous_timeout_ms; /* bound on the whole rendezvous; 0: 600000 */
    int rendezvous_report_ms;  /* while the rendezvous waits, say who is missing this often; 0: 5000;
                                  <0: never */
    dopt_log_fn log_fn;        /* installed on the communicator; also told why a create failed */
    void *log_user;
    void (*on_listen)(void *user, int port); /* rank 0: called once its rendezvous port listens */
    void *on_listen_user;
    char master_host[DOPT_LAUNCH_ADDR_MAX + 1]; /* used when master_addr is NULL: a host name
                                  dopt_tcp_config_from_env derived (Slurm's first node) */
    int on_peer_lost;          /* DOPT_FAIL (0): a lost rank ends the job; DOPT_SHRINK: the survivors
                                  may go on (dopt_comm_shrink; SURVIVING A LOST RANK) */
    int min_ranks;             /* with DOPT_SHRINK: fewer survivors than this end the job; 0: any */
    int keepalive_s;           /* a link idle this long gets a kernel keep-alive probe, repeated as often;
                                  3 unanswered end it (KEEP-ALIVE); 0: 1; <0: off */
    int join;                  /* 1: a restarted process that asks a running job to take it back
                                  (RE-ADMIT); rank and world_size are then the job's to give */
    const char *join_peers;    /* with join: members to ask after rank 0, "host:port,host:port" */
    int listen_port;           /* ranks > 0 and joiners: listen on this port (links, shrinks, joiners);
                                  0: one the kernel picks. Rank 0 listens on master_port */
    int dead_after_ms;         /* > 0: a peer not heard from this long (heartbeats every tenth of it,
                                  over UDP) has its link ended (HEARTBEAT); 0: off; >= 100 */
} dopt_tcp_config;

DOPT_DEF dopt_status dopt_tcp_create(dopt_comm **out, const dopt_tcp_config *cfg);
DOPT_DEF dopt_status dopt_tcp_config_from_env(dopt_tcp_config *cfg);
DOPT_DEF dopt_status dopt_tcp_create_from_env(dopt_comm **out, const dopt_tcp_config *base);
DOPT_DEF dopt_status dopt_tcp_create_from_sockets(dopt_comm **out, const int *fds, const dopt_tcp_config *cfg);

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_TRANSPORT_TCP_H */

/* ==================== REFERENCE FOR CONTRIBUTORS ====================
   Not needed to use transport_tcp.h: how a failure travels between the ranks, which algorithm
   the engine runs when, what waiting costs, and the wire format.

   HOW A FAILURE TRAVELS
   - The rank that detects an error sends every peer an ABORT frame carrying its status, the
     culprit (the dead, silent or mismatching peer; itself for its own errors), itself as the
     reporter, and its reason. A frame it was half-way through sending to a peer is finished
     first (with whatever its buffer holds: the receiver fails anyway), so that the ABORT after
     it can be read; what a peer has not taken within min(timeout_ms, 1 s) is cut and that
     connection shut. Nothing is written afterwards.
   - A rank that receives an ABORT fails with its status and words, " (reported by rank R)"
     added, and passes the same culprit, reporter and words on. A mismatch's words carry both
     calls: "rank 2 called allreduce #7 (f32 sum, 17 elems) and rank 1 allreduce #7 (f32 sum,
     16 elems) (reported by rank 1)".
   - A connection that ends without an ABORT (while this rank needs it) ended with its process:
     at a frame boundary that rank is the culprit ("rank 2 closed the connection", "connection
     to rank 2 lost while sending: Broken pipe"). Mid-frame it may also be a rank cut while
     aborting because of another, so this rank first waits up to min(timeout_ms, 0.5 s) for an
     ABORT from another peer or for another connection to end at a boundary, and names that
     rank instead ("rank 1 closed the connection; rank 2's is closed too"). The wait in progress
     never sleeps past that verdict.
   - A peer a collective ahead sends its ABORT behind its next frame, which this rank parks
     unread until it starts that collective. When such a peer's connection ends (a send fails,
     a reset, or its FIN, which poll reports as POLLRDHUP on a connection this rank does not
     read) while this rank still needs it, what is left of the stream is read and dropped up to
     its end, and the ABORT there is what this rank reports.
   - destroy ends its writing and reads each peer's stream until the peer has acknowledged
     everything written to it (SIOCOUTQ) or ended its own, for at most min(timeout_ms, 2 s): a
     close() with unread bytes would send a reset, which drops what is still queued here (an
     ABORT the peer has not read yet).
   tests/test_faults.c kills each rank of worlds of 3 and 4 at random moments of a run of ring
   allreduces (of 4 MiB, and over TCP of 64 MiB) and checks every survivor's detail and that it
   did not wait for its timeout; tests/test_tcp.c plays each ordering above over socketpairs or
   a loopback connection.

   ALGORITHMS
   The engine is engine.h's (its manual is the link contract). What it does
   on this transport's connections:

   - allreduce: up to small_bytes/(size-1) bytes (or fewer elements than ranks), every rank
     sends its buffer to every other and each combines all inputs in rank order (x0∘x1∘...),
     the same expression everywhere. Larger: ring reduce-scatter then ring allgather, the
     buffer cut into size near-equal segments; each segment is reduced along the ring once and
     its result copied to everyone. The ring is pipelined at byte granularity: a rank forwards
     what it has reduced while the rest of the segment is still arriving, on non-blocking
     sockets polled in both directions (no thread).
   - allreduce across hosts: ranks that listen on the same address share a host. With more
     than one host, the same number L > 1 of ranks on each, and the ring path (two_level AUTO),
     the ring runs in two levels: a reduce-scatter among the host's ranks (over loopback), one
     ring across hosts per local place, each carrying 1/L of the buffer over the host's link,
     and an allgather within the host. A host's link then carries 2·(H−1)/H of the buffer for H
     hosts, against the flat ring's 2·(N−1)/N. Same bits on every rank, run after run.
   - allgather/allgatherv: direct exchange up to small_bytes in all, else a pipelined ring.
   - broadcast: binomial tree up to small_bytes, else a pipelined chain from the root.
   - barrier: dissemination (ceil(log2 size) rounds of header-only frames).

   WAITING
   Blocking round trips cost ~65 us on a VM, spinning ones ~8 us; the
   yield keeps oversubscribed worlds (more ranks than cores) and loopback softirqs moving.

   WIRE FORMAT (all integers little-endian; protocol version DOPT_TCP_PROTOCOL_VERSION = 3)

   An address on the wire is 16 bytes in network order: IPv6 as it is, IPv4 as its IPv4-mapped
   IPv6 form ::ffff:a.b.c.d.

   Handshake record, 96 bytes, the only thing exchanged before a connection is admitted:
       off size  field
         0    4  magic "DOPT"
         4    1  protocol version (3)
         5    1  type: 1 HELLO, 2 ACCEPT, 3 REFUSE, 4 WELCOME, 5 READY, 6 GO, 7 AGAIN
         6    2  HELLO: sender's listening port. REFUSE for a rank taken: the port the
                 connection holding it came from; for a loopback (6): that rank's port; 0 on
                 every other type
         8    4  world size (>= 1)
        12    4  sender's rank (< world size)
        16   16  HELLO: sender's listening address (:: or ::ffff:0.0.0.0, a wildcard: use
                 the address the connection came from). REFUSE for a rank taken: the address
                 the connection holding it came from; for a loopback (6): that address; zero
                 on every other type
        32   64  HELLO and ACCEPT: job token, zero-padded (compared in constant time).
                 REFUSE: 2 bytes the reason (1 token, 2 world size, 3 rank not expected,
                 4 rank taken, 5 version, 6 loopback: a rank would be reached at the
                 loopback address at 16, port at 6, by ranks of other hosts), 2 zero, 4 the
                 rank the refusal is about (reason 6: that rank; else 0), 56 zero. Zero on
                 every other type
   Version 2 had its version as 16 bits at offset 4: a rank of version 2 reads 3 + 256 x type
   there, another version, and refuses; a version 2 HELLO (bytes 4-5 = 2, 0) is answered with a
   REFUSE in version 2's layout (version 2 at 4, type 3 at 6, reason 5 at 22) so that its rank
   reports "different protocol version". Either side fails at once with DOPT_ERR_PROTOCOL.
   Setup: a rank connects, sends HELLO; the acceptor answers ACCEPT (with its own token, which
   the connector checks too) or REFUSE and closes. Once all joined, rank 0 sends each rank
   REFUSE (6) when the table would break LOOPBACK's rule (above), else WELCOME followed by size entries
   of 20 bytes (address 16 bytes, port 2, reserved 2 = 0), the listening addresses of all
   ranks. Each rank k then connects to ranks 1..k-1 (HELLO/ACCEPT), accepts ranks
   k+1..size-1, sends READY to rank 0, and waits for GO. When a rank's connection
   to rank 0 ends before GO, rank 0 sends every other rank AGAIN and closes their connections;
   they close all of theirs and join again from the HELLO. Rank 0 answers HELLOs (ACCEPT or
   REFUSE) on its listening socket as long as its communicator lives.

   Frame header, 48 bytes, before every payload; validated whole before any payload is used:
       off size  field
         0    4  magic "DOPF"
         4    1  protocol version (3)
         5    1  type: 1 DATA, 2 ABORT, 3 GOODBYE
         6    1  collective: 1 allreduce, 2 allgather, 3 allgatherv, 4 broadcast, 5 barrier,
                 6 exchange
                 (0 only on GOODBYE)
         7    1  dtype (0 f32, 1 f64, 2 i32, 3 i64; allreduce, else 0)
         8    1  op (0 sum, 1 max, 2 min, 3 mean; allreduce, else 0)
         9    3  group (24 bits): 0 for the communicator the transport made, else the number
                 dopt_comm_split gave the group the collective runs in
        12    4  sender's rank (in the transport's communicator)
        16    4  root (broadcast, else 0)
        20    4  ABORT: the failure's dopt_status (negative, int32); else 0
        24    8  sequence number of the sender's collective
        32    8  DATA: the collective's count (allreduce: elements; allgather: bytes per
                 rank; allgatherv: total bytes; broadcast: bytes; barrier: 0; exchange: the
                 caller's tag).
                 ABORT: 4 bytes the culprit's rank, then 4 bytes the reporter's rank.
                 GOODBYE: 0
        40    8  payload bytes that follow (ABORT: at most 512, the reporter's reason, without
                 its "rank R: <collective>: " prefix; GOODBYE: 0)
   A DATA frame must carry the receiver's collective (kind, dtype, op, root, group, sequence
   number and count all equal), name the connection's peer as sender, and announce exactly the
   payload the receiver posted for it.
   An ABORT carries the sender's collective (its sequence number decides whether it belongs to
   the receiver's current collective or a later one) and must name ranks of the world; its text
   is read only after the header has passed.
   Collectives send one DATA frame per step (ring step, tree edge, exchange) per peer.

   Survivors' agreement (SURVIVING A LOST RANK), on a connection rank a makes to the listening
   socket of rank b > a after a failure:
       hello, 40 bytes: "DSHR", version 1 (4), the communicator's epoch (4), its size n (4),
       a (4), b (4), proof (8: a 64-bit hash of the token, epoch, n, a and b), 8 zero;
       then a's decision, 8 + 8·⌈n/64⌉ bytes: "DDEC", n (4), a bitmap of the ranks gone
       (bit r of 64-bit word r/64).
   b writes nothing on it. When a and b are both members, the engine's frames follow on it.

   Joiner's handshake (the first step of re-admitting a restarted worker; the admission itself,
   at the driver's round boundary, is not built yet), on a connection the joiner makes to a
   member's listening socket (rank 0's is the master port; every other member of a DOPT_SHRINK
   job listens at its address in the peer table). A member serves it inside its collectives'
   waits, never blocking on it; it holds at most 4 joiners at once, in conversation or held,
   and drops one whose handshake has not ended after 10 s. Every record 64 bytes, "DJON",
   version 1 (1), type (1), 2 zero:
       1 ASK        joiner → member: nonce_j (16), the joiner's listening port (2), 2 zero, its
                    listening address (16), 20 zero
       2 CHALLENGE  member → joiner: nonce_m (16), proof_m (16), the member's epoch (4),
                    communicator size (4) and rank (4), 12 zero
       3 ANSWER     joiner → member: proof_j (16), 40 zero
       4 QUEUED     member → joiner: the joiner is held for the next round boundary; 56 zero
       5 REFUSE     member → joiner: reason (2: 1 token, 2 version, 3 malformed record, 4 the
                    member holds as many joiners as it takes, 5 the job takes no joiners), 54
                    zero; the member then closes
       6 ADMIT      member → held joiner: the grown communicator's epoch (4), size N (4), the
                    joiner's rank (4), the members before the grow n (4), 40 zero; then the
                    table: N entries of 20 bytes (where each rank listens: address (16),
                    port (2), 2 zero), then the nonce_j of each joiner, ranks n .. N-1 (16 each).
                    The member then closes the connection.
   The nonces are 16 bytes from /dev/urandom, drawn afresh by each side for each conversation.
   key = (SipHash-2-4 of the token zero-padded to 64 bytes under two fixed keys, k0 and k1 in
   dopt__join_key); a proof is SipHash-2-4 under key of (label, half, nonce_j, nonce_m, stated)
   for half 0 then 1, 8 bytes each: label 'M' and stated = epoch, size, rank (4 each) for
   proof_m; label 'J' and stated = port (2), address (16) for proof_j. The joiner checks proof_m
   before it answers (a process that is not of the job learns nothing it can use); the member
   checks proof_j, compared in constant time. A recording of a conversation cannot be replayed:
   the other side's nonce differs. It can still be used to test guesses of a short token
   offline: give a job a long random token.

   Links of a grown communicator (dopt_comm_grow), on a connection rank a makes to where rank
   b > a listens: hello, 40 bytes: "DGRW", version 1 (4), the grown communicator's epoch (4), its
   size N (4), a (4), b (4), proof (16: label 'G', nonce_j = b's nonce when b is a joiner, else
   16 zero, nonce_m = 16 zero, stated = epoch, a, b (4 each)). Then the engine's frames.
*/

/* =====================================================================================
   IMPLEMENTATION — stop reading here if you only want the API.
   ===================================================================================== */

#if defined(DISTOPT_IMPLEMENTATION) && !defined(DOPT__TCP_IMPLEMENTED)
#define DOPT__TCP_IMPLEMENTED

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/uio.h>
#ifdef __linux__
#include <linux/sockios.h>
#endif
#include <time.h>
#include <unistd.h>

#ifndef CLOCK_MONOTONIC /* strict -std=c11 hides POSIX unless asked for before the first #include */
#error "transport_tcp.h needs POSIX.1-2008: compile with -D_GNU_SOURCE, or include it before any other header"
#endif

#ifdef __cplusplus
extern "C" {
#endif

/* ===================================================================== CONSTANTS */

#define DOPT__TCP_HS_BYTES 96             /* every handshake record */
#define DOPT__TCP_ENTRY_BYTES 20          /* one rank's listening address in the peer table */
#define DOPT__TCP_ADDR_CHARS 64           /* "[ffff:...:255.255.255.255]:65535" and its NUL */
#define DOPT__TCP_HOST_MAX 256            /* the host part of master_addr or bind_addr, NUL included */
#define DOPT__TCP_MAX_PENDING 32          /* unauthenticated connections held at once */
#define DOPT__TCP_SHRINK_HELLO 40         /* a survivor's hello (WIRE FORMAT) */
#define DOPT__TCP_GROW_HELLO 40           /* a link's hello in dopt_comm_grow (WIRE FORMAT) */
#define DOPT__TCP_MAX_JOINERS 4           /* joiners a member converses with or holds at once (RE-ADMIT) */
#define DOPT__TCP_JOIN_IDLE_MS 10000      /* a joiner's handshake ends within this, or it is dropped */
#define DOPT__TCP_MAX_JOIN_ASKED 8        /* members whose answers a joiner's error names */
#define DOPT__TCP_MAX_GROWN 65536         /* ranks an ADMIT may name: its table is read before the links */
#define DOPT__TCP_LINGER_MS 2000          /* destroy waits at most this long for peers to take its bytes */
#define DOPT__TCP_RENDEZVOUS_DEFAULT_MS 600000 /* see the manual's configuration table */
#define DOPT__TCP_REPORT_DEFAULT_MS 5000
#define DOPT__TCP_KEEPALIVE_PROBES 3     /* unanswered probes that end a link (KEEP-ALIVE) */
#define DOPT__TCP_KEEPALIVE_MAX_S 32767  /* the kernel's bound on TCP_KEEPIDLE and TCP_KEEPINTVL */
#define DOPT__TCP_VERDICT_MS 2000         /* a rank whose peer connection failed in setup waits for rank 0's word */
#define DOPT__TCP_RESTART ((dopt_status)1) /* private: rank 0 said AGAIN, the rendezvous starts over */
#define DOPT__TCP_LOOPBACK_ADVICE /* the end of a refusal for a loopback address (LOOPBACK) */ \
    "give it an address other hosts reach: DOPT_MASTER_ADDR=<rank 0's address as other hosts reach it>, " \
    "DOPT_SOCKET_IFNAME=<interface> or DOPT_BIND_ADDR=<address>"

enum {
    DOPT__TCP_HELLO = 1,
    DOPT__TCP_ACCEPT = 2,
    DOPT__TCP_REFUSE = 3,
    DOPT__TCP_WELCOME = 4,
    DOPT__TCP_READY = 5,
    DOPT__TCP_GO = 6,
    DOPT__TCP_AGAIN = 7
};
enum {
    DOPT__TCP_WRONG_TOKEN = 1,
    DOPT__TCP_WRONG_WORLD = 2,
    DOPT__TCP_WRONG_RANK = 3,
    DOPT__TCP_DUPLICATE_RANK = 4,
    DOPT__TCP_WRONG_VERSION = 5,
    DOPT__TCP_LOOPBACK = 6 /* a rank would be told to other hosts at a loopback address (LOOPBACK) */
};

/* ===================================================================== STATE */

typedef struct dopt__tcp_peer {
    int fd;
    unsigned char addr[16];     /* listening address (setup; see ADDRESSES) */
    uint32_t port;
    unsigned char from[16];     /* where its connection to this rank came from (an acceptor's view) */
    uint32_t from_port;
    unsigned char hs[DOPT__TCP_HS_BYTES]; /* setup: a handshake record being read, bytes [0, hi) */
    size_t hi;
} dopt__tcp_peer;

/* A connection not yet admitted: its address and the handshake record read so far. */
typedef struct dopt__tcp_pending {
    int fd;
    size_t got;
    unsigned char rec[DOPT__TCP_HS_BYTES];
    unsigned char addr[16];
    uint32_t port;
} dopt__tcp_pending;

typedef struct dopt__tcp {
    int rank, size, ready;
    int sockbuf;
    unsigned char token[DOPT_TCP_TOKEN_MAX];
    dopt__tcp_peer *peers;
    struct pollfd *pfd;
    int *pfd_peer;
    /* the rendezvous (rank 0 keeps its listening socket and lobby, to refuse late joiners) */
    int lfd;                    /* listening socket, or -1 */
    dopt__tcp_pending pend[DOPT__TCP_MAX_PENDING]; /* connections not yet admitted */
    int npend;
    int rdv_timeout_ms, report_ms;
    double setup_start, next_report;
    char refusal[DOPT_DETAIL_MAX / 2]; /* the last joiner refused, for rank 0's timeout */
    /* what a shrink's communicator inherits (SHRINK: THE SURVIVORS AGREE) */
    int on_peer_lost;           /* DOPT_FAIL or DOPT_SHRINK */
    int shrink_lfd;             /* every rank but 0 with DOPT_SHRINK: the socket it listens on, or -1 */
    int shrunk;                 /* a shrink made the next communicator: destroy need not linger */
    int parked[DOPT__TCP_MAX_PENDING]; /* hellos of a later shrink that came during this one */
    unsigned char parked_hello[DOPT__TCP_MAX_PENDING][DOPT__TCP_SHRINK_HELLO];
    int nparked;
    int gparked[DOPT__TCP_MAX_PENDING]; /* hellos of a grow that came while this rank still gathered */
    unsigned char gparked_hello[DOPT__TCP_MAX_PENDING][DOPT__TCP_GROW_HELLO];
    int ngparked;
    /* joiners (RE-ADMIT): conversations on the listening socket, and those held */
    struct dopt__tcp_joiner *joiners; /* DOPT__TCP_MAX_JOINERS, allocated for the first */
    int njoiners;
    int two_level, progress_thread_us, spin_us;
    int keepalive_s;            /* the links' keep-alive interval (KEEP-ALIVE), <= 0: off */
    int dead_after_ms;          /* the heartbeat's limit (HEARTBEAT), 0: off */
    struct dopt__tcp_hb *hb;    /* its thread, while this is the job's newest communicator */
    int *silent;                /* per peer: 1 once the heartbeat ended its link */
    size_t small_bytes;
} dopt__tcp;

/* ===================================================================== BYTES AND CLOCK
   (little-endian fields: dopt__put_le32 and friends in distopt.h) */

/* Constant time: the loop never exits early, so the time taken says nothing about where two
   tokens (or proofs) differ. */
static int dopt__tcp_same_bytes(const unsigned char *a, const unsigned char *b, size_t n) {
    unsigned diff = 0;
    size_t i;
    for (i = 0; i < n; i++) diff |= (unsigned)(a[i] ^ b[i]);
    return diff == 0;
}

static int dopt__tcp_token_equal(const unsigned char *a, const unsigned char *b) {
    return dopt__tcp_same_bytes(a, b, DOPT_TCP_TOKEN_MAX);
}

/* ===================================================================== ADDRESSES

   An address is 16 bytes in network order: an IPv6 address as it is, an IPv4 address in its
   IPv4-mapped form ::ffff:a.b.c.d, so that one field of a record or the peer table holds either.
   A socket is made of the family its address is (AF_INET for a mapped one), never a dual-stack
   AF_INET6 socket, which a host booted with IPv6 disabled cannot make. */

static const unsigned char dopt__tcp_v4_prefix[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};

static int dopt__tcp_all_zero(const unsigned char *p, size_t n) {
    size_t i;
    for (i = 0; i < n; i++)
        if (p[i]) return 0;
    return 1;
}

static int dopt__tcp_is_v4(const unsigned char a[16]) { return memcmp(a, dopt__tcp_v4_prefix, 12) == 0; }

static void dopt__tcp_set_v4(unsigned char a[16], const void *in4) {
    memcpy(a, dopt__tcp_v4_prefix, 12);
    memcpy(a + 12, in4, 4);
}

/* 0.0.0.0 or ::, where a rank listens on every address of that family */
static int dopt__tcp_is_any(const unsigned char a[16]) {
    return dopt__tcp_is_v4(a) ? dopt__tcp_all_zero(a + 12, 4) : dopt__tcp_all_zero(a, 16);
}

/* 127.0.0.0/8 or ::1: this host, on every host */
static int dopt__tcp_is_loopback(const unsigned char a[16]) {
    return dopt__tcp_is_v4(a) ? a[12] == 127 : dopt__tcp_all_zero(a, 15) && a[15] == 1;
}

/* fe80::/10 means something only with an interface scope, which no record carries */
static int dopt__tcp_is_link_local(const unsigned char a[16]) { return a[0] == 0xfe && (a[1] & 0xc0) == 0x80; }

/* "1.2.3.4" or "fd00::1" */
static void dopt__tcp_host_str(const unsigned char a[16], char *out, size_t cap) {
    char text[INET6_ADDRSTRLEN];
    if (inet_ntop(dopt__tcp_is_v4(a) ? AF_INET : AF_INET6, dopt__tcp_is_v4(a) ? a + 12 : a, text, sizeof text) == NULL)
        snprintf(text, sizeof text, "?");
    snprintf(out, cap, "%s", text);
}

/* "1.2.3.4:29500" or "[fd00::1]:29500" */
static void dopt__tcp_addr_str(const unsigned char a[16], uint32_t port, char *out, size_t cap) {
    char host[INET6_ADDRSTRLEN];
    dopt__tcp_host_str(a, host, sizeof host);
    snprintf(out, cap, dopt__tcp_is_v4(a) ? "%s:%u" : "[%s]:%u", host, (unsigned)port);
}

/* The socket address of a:port, of a's family; returns its length. */
static socklen_t dopt__tcp_sockaddr(struct sockaddr_storage *ss, const unsigned char a[16], uint32_t port) {
    memset(ss, 0, sizeof *ss);
    if (dopt__tcp_is_v4(a)) {
        struct sockaddr_in *sa = (struct sockaddr_in *)(void *)ss;
        sa->sin_family = AF_INET;
        sa->sin_port = htons((uint16_t)port);
        memcpy(&sa->sin_addr.s_addr, a + 12, 4);
        return (socklen_t)sizeof *sa;
    } else {
        struct sockaddr_in6 *sa = (struct sockaddr_in6 *)(void *)ss;
        sa->sin6_family = AF_INET6;
        sa->sin6_port = htons((uint16_t)port);
        memcpy(&sa->sin6_addr, a, 16);
        return (socklen_t)sizeof *sa;
    }
}

/* The address and port of an IPv4 or IPv6 socket address; 0, or -1 for another family. */
static int dopt__tcp_from_sockaddr(const struct sockaddr_storage *ss, unsigned char a[16], uint32_t *port) {
    if (ss->ss_family == AF_INET) {
        const struct sockaddr_in *sa = (const struct sockaddr_in *)(const void *)ss;
        dopt__tcp_set_v4(a, &sa->sin_addr.s_addr);
        *port = ntohs(sa->sin_port);
        return 0;
    }
    if (ss->ss_family == AF_INET6) {
        const struct sockaddr_in6 *sa = (const struct sockaddr_in6 *)(const void *)ss;
        memcpy(a, &sa->sin6_addr, 16);
        *port = ntohs(sa->sin6_port);
        return 0;
    }
    return -1;
}

/* Splits master_addr or bind_addr text into its host and its port (0: none). The forms: "host",
   "host:29500", "1.2.3.4", "1.2.3.4:29500", "fd00::1" (two colons or more: an IPv6 address,
   which carries no port), "[fd00::1]" and "[fd00::1]:29500". NULL, or what is wrong with it, to
   follow its quoted text in a message. */
static const char *dopt__tcp_split_addr(const char *text, char *host, size_t cap, int *port) {
    const char *end = text + strlen(text), *colon = strrchr(text, ':'), *port_text = NULL;
    size_t len;
    *port = 0;
    if (*text == '[') {
        const char *bracket = strchr(text, ']');
        if (bracket == NULL) return "has a '[' without its ']'";
        if (bracket[1] != '\0' && bracket[1] != ':') return "has text after its ']' that is not :port";
        if (bracket[1] == ':') port_text = bracket + 2;
        text++;
        end = bracket;
    } else if (colon && strchr(text, ':') == colon) { /* exactly one colon: host:port */
        port_text = colon + 1;
        end = colon;
    }
    len = (size_t)(end - text);
    if (len == 0) return "has no host";
    if (len >= cap) return "is too long";
    memcpy(host, text, len);
    host[len] = '\0';
    if (port_text) {
        long v = 0;
        const char *p;
        for (p = port_text; *p >= '0' && *p <= '9' && v <= 65535; p++) v = v * 10 + (*p - '0');
        if (p == port_text || *p != '\0' || v < 1 || v > 65535) return "has a port that is not a number in 1..65535";
        *port = (int)v;
    }
    return NULL;
}

/* ===================================================================== INTERFACES (socket_ifname) */

/* 1 when socket_ifname's list chooses interface `name`. NCCL_SOCKET_IFNAME's rule: a
   comma-separated list of name prefixes ("eth": eth0, eth1, ...); a leading "=" makes them exact
   names; a leading "^" chooses every interface but those ("^=" for exact names). */
static int dopt__tcp_ifname_match(const char *spec, const char *name) {
    int exclude = 0, exact = 0, hit = 0;
    if (*spec == '^') exclude = 1, spec++;
    if (*spec == '=') exact = 1, spec++;
    while (*spec && !hit) {
        size_t len = strcspn(spec, ",");
        if (len > 0 && strncmp(name, spec, len) == 0) hit = !exact || name[len] == '\0';
        spec += len + (spec[len] == ',');
    }
    return hit != exclude;
}

/* 1 when the list names at least one interface or prefix ("", "^", "=," name none). */
static int dopt__tcp_ifname_valid(const char *spec) {
    if (*spec == '^') spec++;
    if (*spec == '=') spec++;
    return spec[strspn(spec, ",")] != '\0';
}

/* The address of an interface entry that a rank can listen on and tell the others about: IPv4 or
   IPv6 but link-local (ADDRESSES), on an interface that is up. 1 when there is one (in a). */
static int dopt__tcp_if_usable(const struct ifaddrs *i, unsigned char a[16]) {
    struct sockaddr_storage ss;
    uint32_t port;
    size_t len;
    if (i->ifa_addr == NULL || !(i->ifa_flags & IFF_UP)) return 0;
    if (i->ifa_addr->sa_family == AF_INET) len = sizeof(struct sockaddr_in);
    else if (i->ifa_addr->sa_family == AF_INET6) len = sizeof(struct sockaddr_in6);
    else return 0;
    memset(&ss, 0, sizeof ss);
    memcpy(&ss, i->ifa_addr, len);
    return dopt__tcp_from_sockaddr(&ss, a, &port) == 0 && !dopt__tcp_is_link_local(a);
}

/* getifaddrs lists an interface's entries (link, IPv4, IPv6) apart: 1 for the first entry of its
   name, which stands for the interface, in the system's order (on Linux `ip link`'s). */
static int dopt__tcp_if_first(const struct ifaddrs *list, const struct ifaddrs *i) {
    const struct ifaddrs *j;
    for (j = list; j != i; j = j->ifa_next)
        if (strcmp(j->ifa_name, i->ifa_name) == 0) return 0;
    return 1;
}

/* Interface i's usable address, of the family asked for (want_v6) when it has both; the first of
   that family as listed. 1 when it has one. */
static int dopt__tcp_if_addr(const struct ifaddrs *i, int want_v6, unsigned char addr[16]) {
    const struct ifaddrs *j;
    int found = 0;
    for (j = i; j; j = j->ifa_next) {
        unsigned char a[16];
        if (strcmp(j->ifa_name, i->ifa_name) != 0 || !dopt__tcp_if_usable(j, a)) continue;
        if (!found || (dopt__tcp_is_v4(addr) == want_v6 && dopt__tcp_is_v4(a) != want_v6)) memcpy(addr, a, 16);
        found = 1;
    }
    return found;
}

/* "lo 127.0.0.1 ::1, eth0 192.0.2.2 fd00::2, ifb0 (down)": every interface and the addresses a
   rank could use there, for a message that says what to choose from. */
static void dopt__tcp_if_list(const struct ifaddrs *list, char *out, size_t cap) {
    const struct ifaddrs *i, *j;
    size_t used = 0;
    int listed = 0, left = 0;
    out[0] = '\0';
    for (i = list; i; i = i->ifa_next) {
        char part[256];
        size_t n;
        int addrs = 0, up = 0;
        if (!dopt__tcp_if_first(list, i)) continue;
        n = (size_t)snprintf(part, sizeof part, "%s%s", listed ? ", " : "", i->ifa_name);
        for (j = i; j; j = j->ifa_next) {
            unsigned char a[16];
            char host[INET6_ADDRSTRLEN];
            if (strcmp(j->ifa_name, i->ifa_name) != 0) continue;
            up |= (j->ifa_flags & IFF_UP) != 0;
            if (!dopt__tcp_if_usable(j, a) || n + sizeof host + 2 > sizeof part) continue;
            dopt__tcp_host_str(a, host, sizeof host);
            n += (size_t)snprintf(part + n, sizeof part - n, " %s", host);
            addrs++;
        }
        if (addrs == 0) n += (size_t)snprintf(part + n, sizeof part - n, up ? " (no usable address)" : " (down)");
        if (used + n + 16 < cap) {
            memcpy(out + used, part, n + 1);
            used += n;
            listed++;
        } else {
            left++;
        }
    }
    if (left) snprintf(out + used, cap - used, " and %d more", left);
}

/* ===================================================================== HANDSHAKE RECORDS */

/* Every handshake message is one fixed 96-byte record (layout: WIRE FORMAT, in the reference above). */
typedef struct dopt__tcp_hs {
    uint32_t version, type, world, rank, port, reason, subject;
    unsigned char addr[16];
    unsigned char token[DOPT_TCP_TOKEN_MAX];
} dopt__tcp_hs;

static void dopt__tcp_hs_encode(unsigned char *out, const dopt__tcp_hs *h) {
    memset(out, 0, DOPT__TCP_HS_BYTES);
    memcpy(out, "DOPT", 4);
    out[4] = (unsigned char)h->version;
    out[5] = (unsigned char)h->type;
    dopt__put_le16(out + 6, h->port);
    dopt__put_le32(out + 8, h->world);
    dopt__put_le32(out + 12, h->rank);
    memcpy(out + 16, h->addr, 16);
    if (h->type == DOPT__TCP_REFUSE) { /* a refusal carries no token: its reason takes the place */
        dopt__put_le16(out + 32, h->reason);
        dopt__put_le32(out + 36, h->subject);
    } else {
        memcpy(out + 32, h->token, DOPT_TCP_TOKEN_MAX);
    }
}

/* NULL when in[0..96) is a well-formed record of this protocol version, else why not. h->version
   is filled even when the version is not ours, so that an acceptor can answer "wrong version"
   (a record of version 2 has its 16-bit version there: 2, then a zero byte). */
static const char *dopt__tcp_hs_decode(const unsigned char *in, dopt__tcp_hs *h) {
    memset(h, 0, sizeof *h);
    if (memcmp(in, "DOPT", 4) != 0) return "bad magic";
    h->version = in[4];
    if (h->version != DOPT_TCP_PROTOCOL_VERSION) return "unknown protocol version";
    h->type = in[5];
    h->port = dopt__get_le16(in + 6);
    h->world = dopt__get_le32(in + 8);
    h->rank = dopt__get_le32(in + 12);
    memcpy(h->addr, in + 16, 16);
    if (h->type < DOPT__TCP_HELLO || h->type > DOPT__TCP_AGAIN) return "unknown record type";
    if (h->world < 1 || h->world > (uint32_t)INT_MAX) return "world size out of range";
    if (h->rank >= h->world) return "rank not below the world size";
    if (h->type != DOPT__TCP_REFUSE) {
        memcpy(h->token, in + 32, DOPT_TCP_TOKEN_MAX);
        return NULL;
    }
    h->reason = dopt__get_le16(in + 32);
    h->subject = dopt__get_le32(in + 36);
    if (h->reason < DOPT__TCP_WRONG_TOKEN || h->reason > DOPT__TCP_LOOPBACK) return "unknown refusal reason";
    if (!dopt__tcp_all_zero(in + 34, 2) || !dopt__tcp_all_zero(in + 40, DOPT__TCP_HS_BYTES - 40))
        return "reserved bytes are not zero";
    if (h->subject >= h->world) return "refusal about a rank not below the world size";
    return NULL;
}

/* One entry of the peer table rank 0 sends after its WELCOME record. */
static const char *dopt__tcp_entry_decode(const unsigned char *in, unsigned char addr[16], uint32_t *port) {
    memcpy(addr, in, 16);
    *port = dopt__get_le16(in + 16);
    if (dopt__get_le16(in + 18) != 0) return "reserved bytes are not zero";
    if (*port == 0) return "port 0";
    return NULL;
}

/* ===================================================================== LINKS

   The engine in distopt.h schedules every collective over these: one connection per peer,
   written and read without blocking. Rank 0 keeps its rendezvous socket in every wait, to refuse
   late joiners at once (RENDEZVOUS: JOINERS). */

static int dopt__tcp_silent(const dopt__tcp *t, int peer);

static long dopt__tcp_link_send(dopt_comm *c, int peer, const dopt_iov *parts, int nparts, int *err) {
    dopt__tcp *t = (dopt__tcp *)c->impl;
    struct iovec iov[4];
    struct msghdr msg;
    int i;
    if (nparts > 4) nparts = 4;
    for (i = 0; i < nparts; i++) {
        iov[i].iov_base = (void *)(uintptr_t)parts[i].base;
        iov[i].iov_len = parts[i].len;
    }
    memset(&msg, 0, sizeof msg);
    msg.msg_iov = iov;
    msg.msg_iovlen = (size_t)nparts;
    for (;;) {
        ssize_t n = sendmsg(t->peers[peer].fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n >= 0) return (long)n;
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        *err = dopt__tcp_silent(t, peer) ? ETIMEDOUT : errno;
        return -1;
    }
}

static long dopt__tcp_link_recv(dopt_comm *c, int peer, void *dst, size_t cap, int *err) {
    dopt__tcp *t = (dopt__tcp *)c->impl;
    for (;;) {
        ssize_t n = recv(t->peers[peer].fd, dst, cap, MSG_DONTWAIT);
        if (n > 0) return (long)n;
        if (n == 0) {
            *err = dopt__tcp_silent(t, peer) ? ETIMEDOUT : 0;
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        *err = dopt__tcp_silent(t, peer) ? ETIMEDOUT : errno;
        return -1;
    }
}

/* With DOPT_SHRINK the link stays open after an abort: its end then means that the peer's
   process died (or left this communicator), which the survivors' agreement watches for. */
static void dopt__tcp_link_close(dopt_comm *c, int peer) {
    dopt__tcp *t = (dopt__tcp *)c->impl;
    if (t->on_peer_lost != DOPT_SHRINK) shutdown(t->peers[peer].fd, SHUT_WR);
}

static int dopt__tcp_lobby_add(dopt_comm *c, dopt__tcp *t, int np);
static int dopt__tcp_lobby_serve(dopt_comm *c, dopt__tcp *t, int from, int np, int lo, int hi);
static int dopt__tcp_joiners_add(dopt_comm *c, dopt__tcp *t, int np);
static void dopt__tcp_joiner_serve(dopt_comm *c, dopt__tcp *t, int j);
static void dopt__tcp_joiners_free(dopt__tcp *t);

/* The socket a member listens on once the job formed: rank 0's rendezvous socket, or the one
   every rank of a DOPT_SHRINK job keeps for the survivors' agreement; -1 for neither. Before
   the job forms it is the rendezvous's own socket. */
static int dopt__tcp_member_lfd(const dopt__tcp *t) {
    if (t->lfd >= 0) return t->lfd;
    return t->ready ? t->shrink_lfd : -1;
}

/* A link the engine does not read is still watched for its end: the peer's FIN (Linux's
   POLLRDHUP, seen while unread bytes wait before it) or a reset (POLLERR, POLLHUP, always on). */
#ifdef POLLRDHUP
#define DOPT__TCP_POLL_END POLLRDHUP
#else
#define DOPT__TCP_POLL_END 0
#endif

static int dopt__tcp_link_wait(dopt_comm *c, dopt_link_poll *polls, int npolls, int timeout_ms, int *err) {
    dopt__tcp *t = (dopt__tcp *)c->impl;
    int i, np, n, ready = 0;
    for (i = 0; i < npolls; i++) {
        t->pfd[i].fd = t->peers[polls[i].peer].fd;
        t->pfd[i].events = (short)(((polls[i].events & DOPT_LINK_IN) ? POLLIN : DOPT__TCP_POLL_END) |
                                   ((polls[i].events & DOPT_LINK_OUT) ? POLLOUT : 0));
        t->pfd[i].revents = 0;
        t->pfd_peer[i] = polls[i].peer;
    }
    np = dopt__tcp_lobby_add(c, t, npolls);
    n = poll(t->pfd, (nfds_t)np, timeout_ms);
    if (n < 0) {
        if (errno == EINTR) return 0;
        *err = errno;
        return -1;
    }
    /* Yield, not just spin: on loopback the peer's packets may be processed by a softirq thread
       that needs this core; pure spinning measured 2x slower. */
    if (n == 0 && timeout_ms == 0) sched_yield();
    for (i = 0; i < npolls; i++) {
        short re = t->pfd[i].revents;
        polls[i].revents = (short)(((re & (POLLIN | POLLHUP | POLLERR | DOPT__TCP_POLL_END)) ? DOPT_LINK_IN : 0) |
                                   ((re & (POLLOUT | POLLHUP | POLLERR)) ? DOPT_LINK_OUT : 0));
        ready += polls[i].revents != 0;
    }
    if (n > 0 && np > npolls) dopt__tcp_lobby_serve(c, t, npolls, np, 1, t->size);
    return ready;
}

/* ===================================================================== HEARTBEAT (dead_after_ms)

   Keep-alive cannot tell a stopped or stuck process from a working one (its kernel answers), and
   counts in whole seconds. With dead_after_ms > 0 each rank runs a thread of its own that sends
   every peer a 48-byte UDP datagram every dead_after_ms / 10 (at least every 10 ms), from and to
   the port each rank listens on (UDP and TCP ports are apart), and ends the link to a peer it has
   not heard from for dead_after_ms: shutdown() of the connection, which wakes a collective
   waiting on it at once, makes the next one fail at its start (DOPT_ERR_PEER_LOST, "Connection
   timed out"), and lets dopt_comm_shrink leave the peer out. The thread watches its own copies of
   the links (dup) for their end, so that a peer whose link ended (it left or died: its kernel
   closed the connection) is not reported as silent as well.

   A datagram: "DHBT", version (4), the sender's listening address (16) and port (4), 4 zero, a
   sequence number (8), and a keyed 64-bit hash of (token, the 40 bytes before it, token): no
   token on the wire; a stranger's, a garbled or an older datagram is dropped. The sender is named
   by the address inside, not by where it came from (a host of several addresses may send from
   another). The thread belongs to the newest communicator of a job: a shrink or a grow hands it
   over with the new peer table, so heartbeats never stop while the survivors agree. A rank that
   cannot bind its UDP port still sends, and notices a silent peer by keep-alive only (it says so). */

#define DOPT__TCP_HB_BYTES 48
#define DOPT__TCP_HB_VERSION 1
#define DOPT__TCP_HB_MIN_MS 100 /* dead_after_ms below this is refused: a heartbeat every 10 ms */

#ifdef DOPT__THREADS
typedef struct dopt__tcp_hb_peer {
    unsigned char addr[16];
    uint32_t port;
    int fd;       /* this thread's copy (dup) of the link, or -1 */
    int ended;    /* the link ended, or this thread ended it: not watched */
    double heard; /* when its last datagram came (or when the table was set) */
    uint64_t seq; /* the highest sequence number heard from it */
} dopt__tcp_hb_peer;

typedef struct dopt__tcp_hb {
    pthread_t thread;
    pthread_mutex_t mu;
    int wake[2];  /* a byte written here wakes the thread: a new table, or stop */
    int ufd;      /* the UDP socket */
    int bound;    /* ufd receives (bound to this rank's listening port) */
    int stop;
    unsigned gen; /* the table's generation: a poll over an older table is dropped */
    dopt_comm *c; /* the communicator it serves now (its log) */
    int *silent;  /* c's flags (dopt__tcp.silent) */
    int rank, size, dead_after_ms, every_ms;
    dopt__tcp_hb_peer *peers;
    unsigned char me[16];
    uint32_t my_port;
    unsigned char token[DOPT_TCP_TOKEN_MAX];
    uint64_t seq;
} dopt__tcp_hb;

static uint64_t dopt__tcp_hb_mac(const unsigned char *token, const unsigned char *msg) {
    uint64_t h = dopt__fnv1a(DOPT__FNV_OFFSET, "distopt heartbeat", 17);
    h = dopt__fnv1a(h, token, DOPT_TCP_TOKEN_MAX);
    h = dopt__fnv1a(h, msg, DOPT__TCP_HB_BYTES - 8);
    return dopt__fnv1a(h, token, DOPT_TCP_TOKEN_MAX);
}

static void dopt__tcp_hb_send(dopt__tcp_hb *h) {
    unsigned char msg[DOPT__TCP_HB_BYTES];
    int p;
    memset(msg, 0, sizeof msg);
    memcpy(msg, "DHBT", 4);
    dopt__put_le32(msg + 4, DOPT__TCP_HB_VERSION);
    memcpy(msg + 8, h->me, 16);
    dopt__put_le32(msg + 24, h->my_port);
    dopt__put_le64(msg + 32, ++h->seq);
    dopt__put_le64(msg + 40, dopt__tcp_hb_mac(h->token, msg));
    for (p = 0; p < h->size; p++) {
        struct sockaddr_storage ss;
        socklen_t len;
        if (p == h->rank || h->peers[p].ended) continue;
        len = dopt__tcp_sockaddr(&ss, h->peers[p].addr, h->peers[p].port);
        (void)sendto(h->ufd, msg, sizeof msg, MSG_DONTWAIT | MSG_NOSIGNAL, (struct sockaddr *)&ss, len);
    }
}

/* Takes every datagram waiting; a member's genuine, newer one marks it heard. */
static void dopt__tcp_hb_receive(dopt__tcp_hb *h, double now) {
    unsigned char msg[DOPT__TCP_HB_BYTES + 1];
    ssize_t n;
    int p;
    while ((n = recv(h->ufd, msg, sizeof msg, MSG_DONTWAIT)) >= 0) {
        uint64_t seq;
        if (n != DOPT__TCP_HB_BYTES || memcmp(msg, "DHBT", 4) != 0 ||
            dopt__get_le32(msg + 4) != DOPT__TCP_HB_VERSION ||
            dopt__get_le64(msg + 40) != dopt__tcp_hb_mac(h->token, msg))
            continue;
        seq = dopt__get_le64(msg + 32);
        for (p = 0; p < h->size; p++)
            if (p != h->rank && h->peers[p].port == dopt__get_le32(msg + 24) &&
                memcmp(h->peers[p].addr, msg + 8, 16) == 0 && seq > h->peers[p].seq) {
                h->peers[p].seq = seq;
                h->peers[p].heard = now;
            }
    }
}

/* Ends the link to peers not heard from for dead_after_ms; returns when the next one would be due. */
static double dopt__tcp_hb_judge(dopt__tcp_hb *h, double now) {
    double due = now + h->every_ms;
    int p;
    for (p = 0; p < h->size; p++) {
        dopt__tcp_hb_peer *P = &h->peers[p];
        if (p == h->rank || P->ended) continue;
        if (now - P->heard < h->dead_after_ms) {
            if (P->heard + h->dead_after_ms < due) due = P->heard + h->dead_after_ms;
            continue;
        }
        P->ended = 1;
        __atomic_store_n(&h->silent[p], 1, __ATOMIC_RELEASE); /* before the shutdown the engine sees */
        if (P->fd >= 0) shutdown(P->fd, SHUT_RDWR);
        dopt_comm_log(h->c, DOPT_LOG_WARN,
                      "rank %d: rank %d not heard from for %.0f ms (dead_after_ms %d): its host is down or cut off, "
                      "or its process is stopped; its link is ended, so collectives fail with DOPT_ERR_PEER_LOST "
                      "naming it (\"Connection timed out\")",
                      h->rank, p, now - P->heard, h->dead_after_ms);
    }
    return due;
}

static void *dopt__tcp_hb_main(void *arg) {
    dopt__tcp_hb *h = (dopt__tcp_hb *)arg;
    struct pollfd *pf = NULL;
    int *who = NULL, cap = 0;
    double next_send = 0;
    pthread_mutex_lock(&h->mu);
    while (!h->stop) {
        double now = dopt__now_ms(), due;
        unsigned gen = h->gen;
        int n = 0, p, i, wait;
        if (now >= next_send) {
            dopt__tcp_hb_send(h);
            next_send = now + h->every_ms;
        }
        if (cap < h->size + 2) {
            DOPT_FREE(pf);
            DOPT_FREE(who);
            pf = (struct pollfd *)DOPT_MALLOC(sizeof *pf * (size_t)(h->size + 2));
            who = (int *)DOPT_MALLOC(sizeof *who * (size_t)(h->size + 2));
            cap = 0;
            if (pf == NULL || who == NULL) { /* cannot watch: sleep and try again */
                pthread_mutex_unlock(&h->mu);
                poll(NULL, 0, h->every_ms);
                pthread_mutex_lock(&h->mu);
                continue;
            }
            cap = h->size + 2;
        }
        due = h->bound ? dopt__tcp_hb_judge(h, now) : next_send;
        if (next_send < due) due = next_send;
        pf[n].fd = h->wake[0], pf[n].events = POLLIN, who[n++] = -1;
        if (h->bound) pf[n].fd = h->ufd, pf[n].events = POLLIN, who[n++] = -2;
        for (p = 0; p < h->size; p++)
            if (p != h->rank && !h->peers[p].ended && h->peers[p].fd >= 0)
                pf[n].fd = h->peers[p].fd, pf[n].events = DOPT__TCP_POLL_END, who[n++] = p;
        for (i = 0; i < n; i++) pf[i].revents = 0;
        wait = (int)(due - now) + 1;
        pthread_mutex_unlock(&h->mu);
        (void)poll(pf, (nfds_t)n, wait < 1 ? 1 : wait);
        pthread_mutex_lock(&h->mu);
        if (h->gen != gen) continue; /* a new table: these fds may be stale */
        for (i = 0; i < n; i++) {
            if (pf[i].revents == 0) continue;
            if (who[i] == -1) {
                char sink[64];
                while (read(h->wake[0], sink, sizeof sink) > 0) continue;
            } else if (who[i] == -2) {
                dopt__tcp_hb_receive(h, dopt__now_ms());
            } else {
                h->peers[who[i]].ended = 1; /* it closed the link: the engine names it */
            }
        }
    }
    pthread_mutex_unlock(&h->mu);
    DOPT_FREE(pf);
    DOPT_FREE(who);
    return NULL;
}

/* The peer table of t (the communicator c) with copies of its links; NULL when out of memory. */
static dopt__tcp_hb_peer *dopt__tcp_hb_table(const dopt__tcp *t) {
    dopt__tcp_hb_peer *P = (dopt__tcp_hb_peer *)DOPT_MALLOC(sizeof *P * (size_t)t->size);
    double now = dopt__now_ms();
    int p;
    if (P == NULL) return NULL;
    for (p = 0; p < t->size; p++) {
        memcpy(P[p].addr, t->peers[p].addr, 16);
        P[p].port = t->peers[p].port;
        P[p].fd = p == t->rank || t->peers[p].fd < 0 ? -1 : fcntl(t->peers[p].fd, F_DUPFD_CLOEXEC, 0);
        P[p].ended = 0;
        P[p].heard = now;
        P[p].seq = 0;
    }
    return P;
}

static void dopt__tcp_hb_table_free(dopt__tcp_hb_peer *P, int n) {
    int p;
    for (p = 0; P && p < n; p++)
        if (P[p].fd >= 0) close(P[p].fd);
    DOPT_FREE(P);
}

/* h serves c (t) with peer table P: the communicator, its ranks, its flags, this rank's address. */
static void dopt__tcp_hb_set(dopt__tcp_hb *h, dopt_comm *c, const dopt__tcp *t, dopt__tcp_hb_peer *P) {
    h->peers = P, h->size = t->size, h->rank = t->rank, h->c = c, h->silent = t->silent;
    memcpy(h->me, t->peers[t->rank].addr, 16);
    h->my_port = t->peers[t->rank].port;
}

/* Installs t's table in h (h now serves c): under the lock, then the thread is woken. */
static dopt_status dopt__tcp_hb_serve(dopt__tcp_hb *h, dopt_comm *c, dopt__tcp *t) {
    dopt__tcp_hb_peer *P = dopt__tcp_hb_table(t), *old;
    int n;
    if (P == NULL) return DOPT_ERR_NOMEM;
    pthread_mutex_lock(&h->mu);
    old = h->peers, n = h->size;
    dopt__tcp_hb_set(h, c, t, P);
    h->gen++;
    pthread_mutex_unlock(&h->mu);
    if (write(h->wake[1], "w", 1) < 0) { /* full: the thread is already woken */
    }
    dopt__tcp_hb_table_free(old, n);
    return DOPT_OK;
}

static void dopt__tcp_hb_stop(dopt__tcp_hb *h) {
    if (h == NULL) return;
    pthread_mutex_lock(&h->mu);
    h->stop = 1;
    pthread_mutex_unlock(&h->mu);
    if (write(h->wake[1], "s", 1) < 0) {
    }
    pthread_join(h->thread, NULL);
    pthread_mutex_destroy(&h->mu);
    dopt__tcp_hb_table_free(h->peers, h->size);
    close(h->ufd);
    close(h->wake[0]);
    close(h->wake[1]);
    DOPT_FREE(h);
}

/* A UDP socket bound to the port this rank listens on (at its address, else any of its family);
   *bound = 0 (with a warning) when neither can be had: it then only sends. */
static int dopt__tcp_hb_socket(dopt_comm *c, const dopt__tcp *t, int *bound) {
    const unsigned char *a = t->peers[t->rank].addr;
    unsigned char any[16];
    struct sockaddr_storage ss;
    socklen_t len;
    char where[DOPT__TCP_ADDR_CHARS];
    int fd = socket(dopt__tcp_is_v4(a) ? AF_INET : AF_INET6, SOCK_DGRAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0), err;
    *bound = 0;
    if (fd < 0) return -1;
    len = dopt__tcp_sockaddr(&ss, a, t->peers[t->rank].port);
    if (bind(fd, (struct sockaddr *)&ss, len) == 0) return *bound = 1, fd;
    err = errno;
    memset(any, 0, sizeof any);
    if (dopt__tcp_is_v4(a)) memcpy(any, dopt__tcp_v4_prefix, 12);
    len = dopt__tcp_sockaddr(&ss, any, t->peers[t->rank].port);
    if (bind(fd, (struct sockaddr *)&ss, len) == 0) return *bound = 1, fd;
    dopt__tcp_addr_str(a, t->peers[t->rank].port, where, sizeof where);
    dopt_comm_log(c, DOPT_LOG_WARN,
                  "rank %d: dead_after_ms: cannot receive heartbeats on UDP %s: %s; this rank sends its own, and "
                  "notices a silent peer by keep-alive only (KEEP-ALIVE)",
                  t->rank, where, strerror(err));
    return fd;
}

/* t's per-peer flags (dopt__tcp.silent), zeroed, made once; 0 when out of memory. */
static int dopt__tcp_silent_flags(dopt__tcp *t) {
    if (t->silent == NULL && (t->silent = (int *)DOPT_MALLOC(sizeof(int) * (size_t)t->size)) != NULL)
        memset(t->silent, 0, sizeof(int) * (size_t)t->size);
    return t->silent != NULL;
}

/* Starts t's heartbeat thread (dead_after_ms > 0, two ranks or more, addresses known). */
static dopt_status dopt__tcp_hb_start(dopt_comm *c, dopt__tcp *t) {
    dopt__tcp_hb *h;
    if (t->dead_after_ms <= 0 || t->size < 2 || t->hb) return DOPT_OK;
    if (dopt__tcp_all_zero(t->peers[t->rank].addr, 16)) {
        dopt_comm_log(c, DOPT_LOG_INFO, "rank %d: dead_after_ms: off, the links were given as sockets and the "
                      "ranks' addresses are unknown", t->rank);
        return DOPT_OK;
    }
    if (!dopt__tcp_silent_flags(t) || (h = (dopt__tcp_hb *)DOPT_MALLOC(sizeof *h)) == NULL)
        return dopt_comm_fail(c, NULL, DOPT_ERR_NOMEM, "dead_after_ms: out of memory");
    memset(h, 0, sizeof *h);
    h->dead_after_ms = t->dead_after_ms;
    h->every_ms = t->dead_after_ms / 10;
    memcpy(h->token, t->token, DOPT_TCP_TOKEN_MAX);
    h->ufd = dopt__tcp_hb_socket(c, t, &h->bound);
    if (h->ufd < 0 || pipe2(h->wake, O_CLOEXEC | O_NONBLOCK) != 0) {
        int err = errno;
        if (h->ufd >= 0) close(h->ufd);
        DOPT_FREE(h);
        return dopt_comm_fail(c, NULL, DOPT_ERR_IO, "dead_after_ms: cannot make the heartbeat's sockets: %s",
                              strerror(err));
    }
    pthread_mutex_init(&h->mu, NULL);
    dopt__tcp_hb_set(h, c, t, dopt__tcp_hb_table(t));
    if (h->peers == NULL || pthread_create(&h->thread, NULL, dopt__tcp_hb_main, h) != 0) {
        dopt__tcp_hb_table_free(h->peers, t->size);
        pthread_mutex_destroy(&h->mu);
        close(h->ufd), close(h->wake[0]), close(h->wake[1]);
        DOPT_FREE(h);
        return dopt_comm_fail(c, NULL, DOPT_ERR_NOMEM, "dead_after_ms: cannot start the heartbeat thread");
    }
    t->hb = h;
    return DOPT_OK;
}
#endif

/* c2 (t2), made by a shrink or a grow of from's communicator, takes over from's heartbeat thread
   (so that it never stops while the ranks agree), or starts its own. */
static dopt_status dopt__tcp_hb_take(dopt_comm *c2, dopt__tcp *t2, dopt__tcp *from) {
#ifdef DOPT__THREADS
    dopt_status s;
    if (from == NULL || from->hb == NULL || t2->size < 2) return dopt__tcp_hb_start(c2, t2);
    if (!dopt__tcp_silent_flags(t2) || (s = dopt__tcp_hb_serve(from->hb, c2, t2)) != DOPT_OK)
        return dopt_comm_fail(c2, NULL, DOPT_ERR_NOMEM, "dead_after_ms: out of memory");
    t2->hb = from->hb;
    from->hb = NULL;
#else
    (void)c2, (void)t2, (void)from;
#endif
    return DOPT_OK;
}

/* Whether the heartbeat ended the link to peer (the reason its end is reported as a time-out). */
static int dopt__tcp_silent(const dopt__tcp *t, int peer) {
    return t->silent != NULL && __atomic_load_n(&t->silent[peer], __ATOMIC_ACQUIRE) != 0;
}

/* ===================================================================== DESTROY */

static void dopt__tcp_free(dopt__tcp *t) {
    int p;
    if (t == NULL) return;
#ifdef DOPT__THREADS
    dopt__tcp_hb_stop(t->hb);
#endif
    DOPT_FREE(t->silent);
    if (t->peers)
        for (p = 0; p < t->size; p++)
            if (t->peers[p].fd >= 0) close(t->peers[p].fd);
    if (t->lfd >= 0) close(t->lfd);
    if (t->shrink_lfd >= 0) close(t->shrink_lfd);
    for (p = 0; p < t->npend; p++) close(t->pend[p].fd);
    for (p = 0; p < t->nparked; p++) close(t->parked[p]);
    for (p = 0; p < t->ngparked; p++) close(t->gparked[p]);
    dopt__tcp_joiners_free(t);
    DOPT_FREE(t->peers);
    DOPT_FREE(t->pfd);
    DOPT_FREE(t->pfd_peer);
    DOPT_FREE(t);
}

/* Bytes written to a TCP connection that its peer has not acknowledged yet (the FIN counts as
   one). 0 where that cannot be asked (not Linux), and for other sockets: a socketpair's bytes
   wait in the peer's queue, which nothing this end does can drop. */
static int dopt__tcp_unacked(int fd) {
#if defined(__linux__) && defined(SIOCOUTQ)
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    int n = 0;
    if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0 || (ss.ss_family != AF_INET && ss.ss_family != AF_INET6))
        return 0;
    return ioctl(fd, SIOCOUTQ, &n) == 0 ? n : 0;
#else
    (void)fd;
    return 0;
#endif
}

/* Reads and drops what peer p sends now; 1 while p may send more and has not yet taken all this
   rank wrote to it. */
static int dopt__tcp_linger_peer(dopt__tcp_peer *P) {
    unsigned char sink[16384];
    ssize_t n;
    while ((n = recv(P->fd, sink, sizeof sink, MSG_DONTWAIT)) > 0) continue;
    if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) return 0;
    return dopt__tcp_unacked(P->fd) > 0;
}

/* Ends this rank's writing on every link and reads what peers still send, dropping it, until
   each peer has taken all that was written to it or ended its own stream, for at most wait_ms.
   A close() with unread bytes resets the connection, and the reset throws away what is still
   queued here: the abort a peer parked behind a frame has not read yet, so that it blamed this
   rank for a connection that ended mid-frame (1 report in 144 named the wrong rank). A count of
   reads cannot bound this: the peer may be that far behind. */
static void dopt__tcp_linger(dopt__tcp *t, int wait_ms) {
    double deadline = dopt__now_ms() + wait_ms;
    int p;
    for (p = 0; p < t->size; p++)
        if (p != t->rank && t->peers[p].fd >= 0) shutdown(t->peers[p].fd, SHUT_WR);
    for (;;) {
        int np = 0, left = dopt__ms_left(deadline);
        for (p = 0; p < t->size; p++) {
            if (p == t->rank || t->peers[p].fd < 0 || !dopt__tcp_linger_peer(&t->peers[p])) continue;
            t->pfd[np].fd = t->peers[p].fd;
            t->pfd[np].events = POLLIN;
            t->pfd[np++].revents = 0;
        }
        if (np == 0 || left == 0) return;
        poll(t->pfd, (nfds_t)np, left < 10 ? left : 10); /* acknowledgements wake nothing: look again */
    }
}

/* Says goodbye to every peer (so that a peer still finishing the last collective knows this rank
   left on purpose), lingers until the peers have what was written to them, and frees
   everything. */
static void dopt__tcp_destroy(dopt_comm *c) {
    dopt__tcp *t = (dopt__tcp *)c->impl;
    int wait_ms = c->timeout_ms < DOPT__TCP_LINGER_MS ? c->timeout_ms : DOPT__TCP_LINGER_MS;
    if (t == NULL) return;
    if (t->ready) dopt_links_goodbye(c, c->timeout_ms < 5000 ? c->timeout_ms : 5000);
    if (t->peers && !t->shrunk) dopt__tcp_linger(t, wait_ms); /* after a shrink nobody reads the old links */
    dopt__tcp_free(t);
    c->impl = NULL;
}

static dopt_status dopt__tcp_shrink(dopt_comm *c, dopt_comm **next);
static dopt_status dopt__tcp_grow(dopt_comm *c, dopt_comm **next);
static dopt_status dopt__tcp_grown(dopt_comm *c2, dopt__tcp *t2, dopt__tcp *from);
static dopt_status dopt__tcp_join_job(dopt_comm **out, const dopt_tcp_config *cfg, int master_port);
static int dopt__tcp_grow_hello_ok(const dopt__tcp *t, const unsigned char *in, uint32_t epoch, const unsigned char *nonce);
static int dopt__tcp_comm_joiners_held(const dopt_comm *c);

/* Links only: every collective is the engine's. */
static const dopt_comm_vtable dopt__tcp_vtable = {
    "tcp", NULL, NULL, NULL, NULL, dopt__tcp_destroy, sizeof(dopt_comm_vtable), 0u,
    dopt__tcp_link_send, dopt__tcp_link_recv, dopt__tcp_link_wait, dopt__tcp_link_close, NULL, NULL, dopt_engine_provider,
    dopt__tcp_shrink, dopt__tcp_grow, dopt__tcp_comm_joiners_held};

/* ===================================================================== SOCKETS */

static int dopt__tcp_set_nonblocking(int fd) {
    int fl = fcntl(fd, F_GETFL, 0);
    if (fl < 0 || fcntl(fd, F_SETFL, fl | O_NONBLOCK) < 0) return -1;
    return fcntl(fd, F_SETFD, FD_CLOEXEC);
}

/* Options every data connection gets: no Nagle delay for small frames, and the buffer size
   asked for (set before connect/listen so the window scale is negotiated for it). */
static void dopt__tcp_tune(int fd, int sockbuf) {
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (sockbuf > 0) {
        setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &sockbuf, sizeof sockbuf);
        setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &sockbuf, sizeof sockbuf);
    }
}

/* KEEP-ALIVE. A link idle for secs seconds gets a probe from the kernel, then one every secs
   seconds; DOPT__TCP_KEEPALIVE_PROBES unanswered end the connection (ETIMEDOUT), so that a peer
   whose host died or was cut off without a word (no FIN, no RST) is named at once by the next
   collective, or within about (1 + probes) x secs by one waiting for it, rather than at
   timeout_ms. The kernel does the work; nothing runs in this process while the job is idle. */
static void dopt__tcp_keepalive(int fd, int secs) {
    int one = 1, probes = DOPT__TCP_KEEPALIVE_PROBES;
    if (fd < 0 || secs <= 0) return;
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof one);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &secs, sizeof secs);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &secs, sizeof secs);
    setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &probes, sizeof probes);
}

/* A socket of addr's family (ADDRESSES). */
static int dopt__tcp_new_socket(const unsigned char addr[16], int sockbuf) {
    int fd = socket(dopt__tcp_is_v4(addr) ? AF_INET : AF_INET6, SOCK_STREAM, 0);
    if (fd < 0) return -1;
    if (dopt__tcp_set_nonblocking(fd) < 0) {
        close(fd);
        return -1;
    }
    dopt__tcp_tune(fd, sockbuf);
    return fd;
}

/* ===================================================================== RENDEZVOUS: FAILING AND REPORTING */

/* Records a setup failure without logging it: the rendezvous may yet start over (a rank left
   before the job formed), and a failed create logs its one reason at its end. */
static dopt_status dopt__tcp_setup_fail(dopt_comm *c, dopt_status s, const char *fmt, ...) DOPT_PRINTF(3, 4);
static dopt_status dopt__tcp_setup_fail(dopt_comm *c, dopt_status s, const char *fmt, ...) {
    char msg[DOPT_DETAIL_MAX];
    dopt_log_fn fn = c->log_fn;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->log_fn = NULL;
    dopt_comm_fail(c, NULL, s, "%s", msg);
    c->log_fn = fn;
    return c->error;
}


/* 1 when the rendezvous has waited report_ms more since its last report (the next is then
   scheduled). */
static int dopt__tcp_report_due(dopt__tcp *t) {
    double now = dopt__now_ms();
    if (t->report_ms <= 0 || now < t->next_report) return 0;
    t->next_report = now + t->report_ms;
    return 1;
}

static int dopt__tcp_waited_s(const dopt__tcp *t) { return (int)((dopt__now_ms() - t->setup_start) / 1000.0); }

/* How long a setup poll() may sleep: until the deadline or the next report. */
static int dopt__tcp_setup_ms(const dopt__tcp *t, double deadline) {
    double until = deadline;
    if (t->report_ms > 0 && t->next_report < until) until = t->next_report;
    return dopt__ms_left(until);
}

/* "rank 3" or "ranks 1, 3": the ranks of [lo, hi) not connected yet (ready = 0), or connected
   but not yet READY (ready = 1, rank 0). Returns how many. */
static int dopt__tcp_list(const dopt__tcp *t, int lo, int hi, int ready, char *out, size_t cap) {
    int r, n = 0, listed = 0;
    size_t used;
    for (r = lo; r < hi; r++) n += ready ? t->peers[r].hi < DOPT__TCP_HS_BYTES : t->peers[r].fd < 0;
    used = (size_t)snprintf(out, cap, "rank%s ", n == 1 ? "" : "s");
    for (r = lo; r < hi && used + 24 < cap; r++)
        if (ready ? t->peers[r].hi < DOPT__TCP_HS_BYTES : t->peers[r].fd < 0)
            used += (size_t)snprintf(out + used, cap - used, "%s%d", listed++ ? ", " : "", r);
    if (listed < n) snprintf(out + used, cap - used, " and %d more", n - listed);
    return n;
}

/* ===================================================================== RENDEZVOUS: WAITING ON SOCKETS */

static dopt_status dopt__tcp_setup_lost(dopt_comm *c, int watch_fd, double deadline);

/* Waits until fd is ready for events, watching watch_fd (rank 0's connection, or -1) and saying
   every report_ms that it waits for `what`. DOPT_OK, TIMEOUT, AGAIN or the watch's failure. */
static dopt_status dopt__tcp_wait(dopt_comm *c, int fd, short events, double deadline, int watch_fd, const char *what) {
    dopt__tcp *t = (dopt__tcp *)c->impl;
    for (;;) {
        struct pollfd pf[2];
        int n, np = 1;
        pf[0].fd = fd;
        pf[0].events = events;
        pf[0].revents = 0;
        if (watch_fd >= 0) {
            pf[1].fd = watch_fd;
            pf[1].events = POLLIN;
            pf[1].revents = 0;
            np = 2;
        }
        if (dopt__tcp_report_due(t))
            dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: waiting for %s (%d s)", t->rank, what, dopt__tcp_waited_s(t));
        n = poll(pf, (nfds_t)np, dopt__tcp_setup_ms(t, deadline));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "poll: %s", strerror(errno));
        if (np == 2 && pf[1].revents) {
            dopt_status s = dopt__tcp_setup_lost(c, watch_fd, deadline);
            if (s != DOPT_OK) return s;
        }
        if (pf[0].revents) return DOPT_OK;
        if (dopt__now_ms() >= deadline)
            return dopt__tcp_setup_fail(c, DOPT_ERR_TIMEOUT, "timed out after %d ms waiting for %s", t->rdv_timeout_ms,
                                        what);
    }
}

static dopt_status dopt__tcp_send_all(dopt_comm *c, int fd, const unsigned char *buf, size_t n, double deadline,
                                      const char *who) {
    char what[96];
    snprintf(what, sizeof what, "%s to read", who);
    while (n > 0) {
        ssize_t k = send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            buf += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR) continue;
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            dopt_status s = dopt__tcp_wait(c, fd, POLLOUT, deadline, -1, what);
            if (s != DOPT_OK) return s;
            continue;
        }
        return dopt__tcp_setup_fail(c, DOPT_ERR_PEER_LOST, "lost %s during setup: %s", who, strerror(errno));
    }
    return DOPT_OK;
}

/* Reads n bytes from `who`; `what` says what the wait is for (reports, timeout). */
static dopt_status dopt__tcp_recv_all(dopt_comm *c, int fd, unsigned char *buf, size_t n, double deadline, int watch_fd,
                                      const char *who, const char *what) {
    while (n > 0) {
        ssize_t k = recv(fd, buf, n, MSG_DONTWAIT);
        if (k > 0) {
            buf += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0)
            return dopt__tcp_setup_fail(c, DOPT_ERR_PEER_LOST, "%s closed the connection during setup", who);
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            dopt_status s = dopt__tcp_wait(c, fd, POLLIN, deadline, watch_fd, what);
            if (s != DOPT_OK) return s;
            continue;
        }
        return dopt__tcp_setup_fail(c, DOPT_ERR_PEER_LOST, "lost %s during setup: %s", who, strerror(errno));
    }
    return DOPT_OK;
}

/* Every rank but 0 watches its connection to rank 0 during setup: before GO nothing arrives on
   it but AGAIN (rank 0 starts the rendezvous over), and rank 0 closes it when it fails. */
static dopt_status dopt__tcp_setup_lost(dopt_comm *c, int watch_fd, double deadline) {
    unsigned char rec[DOPT__TCP_HS_BYTES];
    dopt__tcp_hs h;
    dopt_status s;
    ssize_t n = recv(watch_fd, rec, 1, MSG_DONTWAIT | MSG_PEEK);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return DOPT_OK;
    if (n <= 0)
        return dopt__tcp_setup_fail(c, DOPT_ERR_PEER_LOST,
                                    "rank 0 closed its connection during setup (rank 0 failed: its log says why)");
    s = dopt__tcp_recv_all(c, watch_fd, rec, sizeof rec, deadline, -1, "rank 0", "the rest of rank 0's record");
    if (s != DOPT_OK) return s;
    if (dopt__tcp_hs_decode(rec, &h) == NULL && h.type == DOPT__TCP_AGAIN && h.rank == 0) return DOPT__TCP_RESTART;
    return dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL, "rank 0 sent an unexpected record during setup");
}

/* A name or an address, in one of dopt__tcp_split_addr's forms (its port aside), to an address.
   A name may give several: the first IPv4 or
   IPv6 one, in the order getaddrinfo gives them (RFC 6724's, which puts addresses this host cannot
   reach last; /etc/gai.conf can change it), that is not link-local IPv6 (ADDRESSES). */
static dopt_status dopt__tcp_resolve(dopt_comm *c, const char *text, unsigned char addr[16]) {
    struct addrinfo hints, *res = NULL, *ai;
    char host[DOPT__TCP_HOST_MAX];
    int rc, link_local = 0, port;
    if (dopt__tcp_split_addr(text, host, sizeof host, &port) != NULL) /* checked by dopt__tcp_check_addrs */
        return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "cannot parse \"%s\"", text);
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    rc = getaddrinfo(host, NULL, &hints, &res);
    if (rc != 0 || res == NULL)
        return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "cannot resolve \"%s\": %s", host,
                                    rc ? gai_strerror(rc) : "no address");
    for (ai = res; ai; ai = ai->ai_next) {
        struct sockaddr_storage ss;
        uint32_t port;
        if (ai->ai_addrlen > sizeof ss) continue;
        memset(&ss, 0, sizeof ss);
        memcpy(&ss, ai->ai_addr, ai->ai_addrlen);
        if (dopt__tcp_from_sockaddr(&ss, addr, &port) < 0) continue;
        if (!dopt__tcp_is_link_local(addr)) break;
        link_local = 1;
    }
    freeaddrinfo(res);
    if (ai == NULL)
        return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "cannot use \"%s\": %s", host,
                                    link_local ? "a link-local IPv6 address (fe80::/10) needs an interface scope, "
                                                 "which the other ranks cannot be told; use a global or "
                                                 "unique-local address"
                                               : "no IPv4 or IPv6 address");
    return DOPT_OK;
}

/* The address of this host that socket_ifname chooses: of the interfaces it matches, the first in
   the system's order that is up with a usable address (dopt__tcp_if_usable); of that interface's
   addresses, one of the family asked for (want_v6) when it has both. INVALID naming the
   interfaces there are when it matches none; ifname gets the interface's name. */
static dopt_status dopt__tcp_ifname_addr(dopt_comm *c, const char *spec, int want_v6, unsigned char addr[16],
                                         char *ifname, size_t cap) {
    struct ifaddrs *list = NULL, *i;
    char there[DOPT_DETAIL_MAX / 2 + 64];
    if (getifaddrs(&list) < 0)
        return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "socket_ifname \"%s\": getifaddrs: %s", spec, strerror(errno));
    for (i = list; i; i = i->ifa_next)
        if (dopt__tcp_if_first(list, i) && dopt__tcp_ifname_match(spec, i->ifa_name) &&
            dopt__tcp_if_addr(i, want_v6, addr)) {
            snprintf(ifname, cap, "%s", i->ifa_name);
            freeifaddrs(list);
            return DOPT_OK;
        }
    dopt__tcp_if_list(list, there, DOPT_DETAIL_MAX / 2 + 64);
    freeifaddrs(list);
    return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID,
                                "socket_ifname \"%s\" matches no interface that is up with an IPv4 or IPv6 address; "
                                "this host has %s",
                                spec, there);
}

static dopt_status dopt__tcp_listen(dopt_comm *c, dopt__tcp *t, const unsigned char addr[16], uint32_t port,
                                    int *fd_out, uint32_t *port_out) {
    struct sockaddr_storage ss;
    socklen_t len = dopt__tcp_sockaddr(&ss, addr, port);
    unsigned char bound[16];
    char where[DOPT__TCP_ADDR_CHARS];
    int one = 1, fd = dopt__tcp_new_socket(addr, t->sockbuf);
    dopt__tcp_addr_str(addr, port, where, sizeof where);
    if (fd < 0) return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "cannot listen on %s: socket: %s", where, strerror(errno));
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(fd, (struct sockaddr *)&ss, len) < 0 || listen(fd, SOMAXCONN) < 0 ||
        (len = sizeof ss, getsockname(fd, (struct sockaddr *)&ss, &len)) < 0) {
        int err = errno;
        close(fd);
        return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "cannot listen on %s: %s", where, strerror(err));
    }
    *fd_out = fd;
    (void)dopt__tcp_from_sockaddr(&ss, bound, port_out);
    return DOPT_OK;
}

/* Connects to addr:port, retrying with backoff (10 ms doubling to 500 ms) while nobody listens
   there yet, until the deadline; says every report_ms that it is still trying and why. */
static dopt_status dopt__tcp_connect(dopt_comm *c, dopt__tcp *t, const unsigned char addr[16], uint32_t port,
                                     double deadline, int watch_fd, const char *who, int *fd_out) {
    int backoff = 10, tries = 0, err = 0;
    for (;;) {
        struct sockaddr_storage ss;
        socklen_t ss_len = dopt__tcp_sockaddr(&ss, addr, port), len = sizeof err;
        int fd;
        dopt_status s;
        if (err && dopt__tcp_report_due(t)) /* why the last try failed: the report to look for */
            dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: waiting for %s (%s, %d s)", t->rank, who, strerror(err),
                          dopt__tcp_waited_s(t));
        fd = dopt__tcp_new_socket(addr, t->sockbuf);
        err = 0;
        if (fd < 0)
            return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "cannot connect to %s: socket: %s", who, strerror(errno));
        tries++;
        if (connect(fd, (struct sockaddr *)&ss, ss_len) < 0) {
            err = errno;
            if (err == EINPROGRESS) {
                s = dopt__tcp_wait(c, fd, POLLOUT, deadline, watch_fd, who);
                if (s != DOPT_OK) {
                    close(fd);
                    return s;
                }
                if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
            }
        }
        if (err == 0) {
            *fd_out = fd;
            return DOPT_OK;
        }
        close(fd);
        if (err != ECONNREFUSED && err != ETIMEDOUT && err != ECONNRESET && err != EHOSTUNREACH &&
            err != ENETUNREACH && err != EAGAIN)
            return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "cannot connect to %s: %s", who, strerror(err));
        if (dopt__now_ms() + backoff >= deadline)
            return dopt__tcp_setup_fail(c, DOPT_ERR_TIMEOUT, "could not connect to %s within %d ms (%d tries): %s", who,
                                        t->rdv_timeout_ms, tries, strerror(err));
        if (watch_fd >= 0) {
            struct pollfd pf;
            pf.fd = watch_fd;
            pf.events = POLLIN;
            pf.revents = 0;
            if (poll(&pf, 1, backoff) > 0 && (s = dopt__tcp_setup_lost(c, watch_fd, deadline)) != DOPT_OK) return s;
        } else {
            poll(NULL, 0, backoff);
        }
        backoff = backoff * 2 > 500 ? 500 : backoff * 2;
    }
}

/* ===================================================================== RENDEZVOUS: HANDSHAKE */

static void dopt__tcp_hs_init(dopt__tcp_hs *h, const dopt__tcp *t, uint32_t type) {
    memset(h, 0, sizeof *h);
    h->version = DOPT_TCP_PROTOCOL_VERSION;
    h->type = type;
    h->world = (uint32_t)t->size;
    h->rank = (uint32_t)t->rank;
}

static dopt_status dopt__tcp_send_record(dopt_comm *c, dopt__tcp *t, int fd, uint32_t type, double deadline,
                                         const char *who) {
    unsigned char rec[DOPT__TCP_HS_BYTES];
    dopt__tcp_hs h;
    dopt__tcp_hs_init(&h, t, type);
    if (type == DOPT__TCP_ACCEPT) memcpy(h.token, t->token, DOPT_TCP_TOKEN_MAX);
    dopt__tcp_hs_encode(rec, &h);
    return dopt__tcp_send_all(c, fd, rec, sizeof rec, deadline, who);
}

static dopt_status dopt__tcp_refused(dopt_comm *c, const dopt__tcp *t, const dopt__tcp_hs *h, const char *who) {
    char holder[DOPT__TCP_ADDR_CHARS];
    switch (h->reason) {
    case DOPT__TCP_WRONG_TOKEN:
        return dopt__tcp_setup_fail(c, DOPT_ERR_AUTH, "%s refused this rank: the job token differs", who);
    case DOPT__TCP_WRONG_WORLD:
        return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "%s refused this rank: its world size is %u, this rank's %d",
                                    who, (unsigned)h->world, t->size);
    case DOPT__TCP_DUPLICATE_RANK:
        dopt__tcp_addr_str(h->addr, h->port, holder, sizeof holder);
        return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "rank %d is already taken by %s (%s refused this process)",
                                    t->rank, holder, who);
    case DOPT__TCP_WRONG_RANK:
        return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "%s refused this rank: it does not admit rank %d", who,
                                    t->rank);
    case DOPT__TCP_LOOPBACK:
        dopt__tcp_addr_str(h->addr, h->port, holder, sizeof holder);
        return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID,
                                    "%s refused the job: rank %u%s would be reached at %s, a loopback address, and "
                                    "ranks joined from other hosts, which cannot reach it there (rank 0's log says "
                                    "which); %s",
                                    who, (unsigned)h->subject, h->subject == (uint32_t)t->rank ? " (this rank)" : "",
                                    holder, DOPT__TCP_LOOPBACK_ADVICE);
    }
    return dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL, "%s refused this rank: different protocol version", who);
}

/* A record that did not decode, from `who`: another protocol version is said as such, since it is
   what a rank of another release of distopt sends (version 2 reads ours as another version too). */
static dopt_status dopt__tcp_malformed(dopt_comm *c, const dopt__tcp_hs *h, const char *why, const char *who) {
    if (h->version != DOPT_TCP_PROTOCOL_VERSION && h->version != 0)
        return dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL,
                                    "%s speaks protocol version %u, this rank version %d (another release of "
                                    "distopt: give every rank the same one)",
                                    who, (unsigned)h->version, DOPT_TCP_PROTOCOL_VERSION);
    return dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL, "%s sent a malformed handshake record: %s", who, why);
}

/* Reads one record of the given type from rank `from`; from rank 0, AGAIN instead says the
   rendezvous starts over. */
static dopt_status dopt__tcp_recv_record(dopt_comm *c, dopt__tcp *t, int fd, int from, uint32_t type, double deadline,
                                         const char *who, const char *what, dopt__tcp_hs *h) {
    unsigned char rec[DOPT__TCP_HS_BYTES];
    const char *why;
    dopt_status s = dopt__tcp_recv_all(c, fd, rec, sizeof rec, deadline, -1, who, what);
    if (s != DOPT_OK) return s;
    why = dopt__tcp_hs_decode(rec, h);
    if (why) return dopt__tcp_malformed(c, h, why, who);
    if (from == 0 && h->type == DOPT__TCP_AGAIN && h->rank == 0) return DOPT__TCP_RESTART;
    if (from == 0 && h->type == DOPT__TCP_REFUSE && h->rank == 0) return dopt__tcp_refused(c, t, h, who);
    if (h->type != type || h->world != (uint32_t)t->size || h->rank != (uint32_t)from)
        return dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL,
                                    "%s sent record type %u of rank %u in a world of %u, expected type %u of rank %d "
                                    "of %d",
                                    who, (unsigned)h->type, (unsigned)h->rank, (unsigned)h->world, (unsigned)type, from,
                                    t->size);
    return DOPT_OK;
}


/* The connecting side: HELLO with our rank, listening address and token; the acceptor answers
   ACCEPT with its own token (checked too: a process of another job is not a peer) or REFUSE. */
static dopt_status dopt__tcp_hello(dopt_comm *c, dopt__tcp *t, int fd, int peer, const unsigned char my_addr[16],
                                   uint32_t my_port, double deadline, int watch_fd, const char *who) {
    unsigned char rec[DOPT__TCP_HS_BYTES];
    char what[96];
    dopt__tcp_hs h;
    const char *why;
    dopt_status s;
    snprintf(what, sizeof what, "%s to answer", who);
    dopt__tcp_hs_init(&h, t, DOPT__TCP_HELLO);
    memcpy(h.addr, my_addr, 16);
    h.port = my_port;
    memcpy(h.token, t->token, DOPT_TCP_TOKEN_MAX);
    dopt__tcp_hs_encode(rec, &h);
    s = dopt__tcp_send_all(c, fd, rec, sizeof rec, deadline, who);
    if (s == DOPT_OK) s = dopt__tcp_recv_all(c, fd, rec, sizeof rec, deadline, watch_fd, who, what);
    if (s != DOPT_OK) return s;
    why = dopt__tcp_hs_decode(rec, &h);
    if (why) return dopt__tcp_malformed(c, &h, why, who);
    if (h.type == DOPT__TCP_REFUSE) return dopt__tcp_refused(c, t, &h, who);
    if (h.type != DOPT__TCP_ACCEPT || h.rank != (uint32_t)peer || h.world != (uint32_t)t->size)
        return dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL, "%s answered as rank %u of %u with record type %u", who,
                                    (unsigned)h.rank, (unsigned)h.world, (unsigned)h.type);
    if (!dopt__tcp_token_equal(h.token, t->token))
        return dopt__tcp_setup_fail(c, DOPT_ERR_AUTH, "%s presented a different job token", who);
    return DOPT_OK;
}

/* ===================================================================== RENDEZVOUS: JOINERS */

/* A REFUSE for another version in the layout of version 2 (16-bit version at 4, type at 6, reason
   at 22), so that a rank of that release reads "different protocol version", not a record it
   cannot parse. */
static void dopt__tcp_v2_refusal(unsigned char *out, const dopt__tcp *t) {
    memset(out, 0, DOPT__TCP_HS_BYTES);
    memcpy(out, "DOPT", 4);
    dopt__put_le16(out + 4, 2);
    dopt__put_le16(out + 6, DOPT__TCP_REFUSE);
    dopt__put_le32(out + 8, (uint32_t)t->size);
    dopt__put_le32(out + 12, (uint32_t)t->rank);
    dopt__put_le16(out + 22, DOPT__TCP_WRONG_VERSION);
}

/* Refuses connection q, saying why in the log (WARN) and, for a joiner (h: its HELLO), in a
   REFUSE record; a rank already taken is answered with where its holder connected from. */
static void dopt__tcp_refuse(dopt_comm *c, dopt__tcp *t, dopt__tcp_pending *q, const dopt__tcp_hs *h, uint32_t reason,
                             const char *why) {
    char from[DOPT__TCP_ADDR_CHARS];
    dopt__tcp_addr_str(q->addr, q->port, from, sizeof from);
    if (h) {
        snprintf(t->refusal, sizeof t->refusal, "a joiner from %s claiming rank %u: %s", from, (unsigned)h->rank, why);
        dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: refused %s", t->rank, t->refusal);
    } else {
        dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: refused a connection from %s: %s", t->rank, from, why);
    }
    if (reason) {
        unsigned char rec[DOPT__TCP_HS_BYTES];
        dopt__tcp_hs answer;
        dopt__tcp_hs_init(&answer, t, DOPT__TCP_REFUSE);
        answer.reason = reason;
        if (reason == DOPT__TCP_DUPLICATE_RANK && h) {
            memcpy(answer.addr, t->peers[h->rank].from, 16);
            answer.port = t->peers[h->rank].from_port;
        }
        if (reason == DOPT__TCP_WRONG_VERSION && q->rec[4] == 2 && q->rec[5] == 0)
            dopt__tcp_v2_refusal(rec, t);
        else
            dopt__tcp_hs_encode(rec, &answer);
        (void)!send(q->fd, rec, sizeof rec, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
    close(q->fd);
    q->fd = -1;
}

/* The records a listening socket takes: a rank's HELLO ("DOPT", 96 bytes) during the rendezvous,
   and once the job formed a joiner's ASK ("DJON": read 4 bytes, then the joiner's conversation
   reads on) or a survivor's hello of a shrink this rank has not started yet ("DSHR", 40). */
static int dopt__tcp_known_magic(const unsigned char *rec, size_t got) {
    size_t n = got < 4 ? got : 4;
    return memcmp(rec, "DOPT", n) == 0 || memcmp(rec, "DJON", n) == 0 || memcmp(rec, "DSHR", n) == 0 ||
           memcmp(rec, "DGRW", n) == 0;
}

static size_t dopt__tcp_pending_want(const dopt__tcp_pending *q) {
    if (q->got < 4) return 4;
    if (memcmp(q->rec, "DSHR", 4) == 0) return DOPT__TCP_SHRINK_HELLO;
    if (memcmp(q->rec, "DGRW", 4) == 0) return DOPT__TCP_GROW_HELLO;
    if (memcmp(q->rec, "DJON", 4) == 0) return 4;
    return sizeof q->rec;
}

static int dopt__tcp_lobby_other(dopt_comm *c, dopt__tcp *t, dopt__tcp_pending *q);

/* Reads from one unauthenticated connection. Returns 1 when it joined as a rank in [lo, hi),
   -1 when it was refused and closed, 0 while its HELLO is incomplete. A stranger never fails the
   job: it is refused and the rendezvous goes on. */
static int dopt__tcp_pending_read(dopt_comm *c, dopt__tcp *t, dopt__tcp_pending *q, int lo, int hi) {
    dopt__tcp_hs h, answer;
    const char *why;
    char text[96 + DOPT__TCP_ADDR_CHARS], holder[DOPT__TCP_ADDR_CHARS];
    size_t want;
    while (q->got < (want = dopt__tcp_pending_want(q))) { /* never past the record: what follows is not ours */
        ssize_t n = recv(q->fd, q->rec + q->got, want - q->got, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
        if (n <= 0) {
            dopt__tcp_refuse(c, t, q, NULL, 0, "closed before its handshake");
            return -1;
        }
        q->got += (size_t)n;
        if (!dopt__tcp_known_magic(q->rec, q->got)) {
            dopt__tcp_refuse(c, t, q, NULL, 0, "not a distopt handshake");
            return -1;
        }
    }
    if (memcmp(q->rec, "DOPT", 4) != 0) return dopt__tcp_lobby_other(c, t, q); /* a joiner, or a survivor */
    why = dopt__tcp_hs_decode(q->rec, &h);
    if (why && h.version != DOPT_TCP_PROTOCOL_VERSION && h.version != 0) {
        snprintf(text, sizeof text, "protocol version %u, this rank's %d", (unsigned)h.version,
                 DOPT_TCP_PROTOCOL_VERSION);
        dopt__tcp_refuse(c, t, q, NULL, DOPT__TCP_WRONG_VERSION, text);
        return -1;
    }
    if (why || h.type != DOPT__TCP_HELLO) {
        dopt__tcp_refuse(c, t, q, NULL, 0, why ? why : "not a HELLO");
        return -1;
    }
    if (!dopt__tcp_token_equal(h.token, t->token)) {
        dopt__tcp_refuse(c, t, q, &h, DOPT__TCP_WRONG_TOKEN, "token differs");
        return -1;
    }
    if (h.world != (uint32_t)t->size) {
        snprintf(text, sizeof text, "its world size is %u, this job's %d", (unsigned)h.world, t->size);
        dopt__tcp_refuse(c, t, q, &h, DOPT__TCP_WRONG_WORLD, text);
        return -1;
    }
    if (h.rank < (uint32_t)lo || h.rank >= (uint32_t)hi) {
        snprintf(text, sizeof text, "rank %d admits ranks %d to %d only", t->rank, lo, hi - 1);
        dopt__tcp_refuse(c, t, q, &h, DOPT__TCP_WRONG_RANK, text);
        return -1;
    }
    if (t->peers[h.rank].fd >= 0) {
        dopt__tcp_addr_str(t->peers[h.rank].from, t->peers[h.rank].from_port, holder, sizeof holder);
        snprintf(text, sizeof text, "rank %u is already taken by %s", (unsigned)h.rank, holder);
        dopt__tcp_refuse(c, t, q, &h, DOPT__TCP_DUPLICATE_RANK, text);
        return -1;
    }
    dopt__tcp_hs_init(&answer, t, DOPT__TCP_ACCEPT);
    memcpy(answer.token, t->token, DOPT_TCP_TOKEN_MAX);
    dopt__tcp_hs_encode(q->rec, &answer);
    /* a fresh connection always has room for one record; one that has not is not worth waiting for */
    if (send(q->fd, q->rec, sizeof q->rec, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof q->rec) {
        dopt__tcp_refuse(c, t, q, NULL, 0, "closed during its handshake");
        return -1;
    }
    /* a rank that listens on the wildcard address is reached at the address it came from */
    memcpy(t->peers[h.rank].addr, dopt__tcp_is_any(h.addr) ? q->addr : h.addr, 16);
    t->peers[h.rank].port = h.port;
    memcpy(t->peers[h.rank].from, q->addr, 16);
    t->peers[h.rank].from_port = q->port;
    t->peers[h.rank].fd = q->fd;
    q->fd = -1;
    return 1;
}

/* Appends the listening socket and the connections not yet admitted to t->pfd from index np;
   returns the new count. */
static int dopt__tcp_lobby_add(dopt_comm *c, dopt__tcp *t, int np) {
    int i, lfd = dopt__tcp_member_lfd(t);
    if (lfd < 0) return np;
    t->pfd[np].fd = lfd;
    t->pfd[np].events = POLLIN;
    t->pfd[np].revents = 0;
    t->pfd_peer[np++] = -1;
    for (i = 0; i < t->npend; i++) {
        t->pfd[np].fd = t->pend[i].fd;
        t->pfd[np].events = POLLIN;
        t->pfd[np].revents = 0;
        t->pfd_peer[np++] = -2 - i;
    }
    return dopt__tcp_joiners_add(c, t, np);
}

/* Serves the entries [from, np) that dopt__tcp_lobby_add put in t->pfd: reads HELLOs, admits
   ranks of [lo, hi) whose place is free, refuses the others, accepts new connections (holding
   up to DOPT__TCP_MAX_PENDING without a handshake, so that silent strangers cannot stall the
   job: the oldest is dropped first). Returns how many ranks joined. */
static int dopt__tcp_lobby_serve(dopt_comm *c, dopt__tcp *t, int from, int np, int lo, int hi) {
    int i, joined = 0, listening = 0;
    for (i = np - 1; i >= from; i--) { /* backwards: removing pend[k] moves a later one, already served, into it */
        int k, r;
        if (!t->pfd[i].revents) continue;
        if (t->pfd_peer[i] == -1) {
            listening = 1;
            continue;
        }
        k = -2 - t->pfd_peer[i];
        if (k >= DOPT__TCP_MAX_PENDING) { /* a joiner's conversation */
            dopt__tcp_joiner_serve(c, t, k - DOPT__TCP_MAX_PENDING);
            continue;
        }
        r = dopt__tcp_pending_read(c, t, &t->pend[k], lo, hi);
        if (r == 0) continue;
        joined += r > 0;
        t->pend[k] = t->pend[--t->npend];
    }
    while (listening) {
        struct sockaddr_storage ss;
        socklen_t len = sizeof ss;
        int fd = accept(dopt__tcp_member_lfd(t), (struct sockaddr *)&ss, &len);
        if (fd < 0) break;
        if (dopt__tcp_set_nonblocking(fd) < 0) {
            close(fd);
            continue;
        }
        dopt__tcp_tune(fd, 0);
        if (t->npend == DOPT__TCP_MAX_PENDING) { /* the oldest has had the longest to speak */
            dopt__tcp_refuse(c, t, &t->pend[0], NULL, 0, "too many connections without a handshake");
            t->pend[0] = t->pend[--t->npend];
        }
        t->pend[t->npend].fd = fd;
        t->pend[t->npend].got = 0;
        if (dopt__tcp_from_sockaddr(&ss, t->pend[t->npend].addr, &t->pend[t->npend].port) < 0) {
            memset(t->pend[t->npend].addr, 0, 16);
            t->pend[t->npend].port = 0;
        }
        t->npend++;
    }
    return joined;
}

/* Rank 0, before the job formed: admitted rank r's connection ended (its process crashed or
   gave up) or spoke out of turn. It is closed and the rank is free again; `then` says what rank
   0 does next. */
static void dopt__tcp_left_early(dopt_comm *c, dopt__tcp *t, int r, const char *how, const char *then) {
    char from[DOPT__TCP_ADDR_CHARS];
    dopt__tcp_addr_str(t->peers[r].from, t->peers[r].from_port, from, sizeof from);
    dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: rank %d (from %s) %s before the job formed; %s", t->rank, r, from, how,
                  then);
    close(t->peers[r].fd);
    t->peers[r].fd = -1;
    t->peers[r].hi = 0;
}

/* Admits ranks lo .. hi-1 on t->lfd until all have joined. Rank 0 also watches the ranks it has
   admitted: one whose connection ends before the job forms frees its rank for the real one.
   The other ranks watch rank 0 (watch_fd). Every report_ms it says who is missing. */
static dopt_status dopt__tcp_admit(dopt_comm *c, dopt__tcp *t, int lo, int hi, double deadline, int watch_fd) {
    char missing[160];
    int joined = 0, r;
    for (r = lo; r < hi; r++) joined += t->peers[r].fd >= 0;
    while (joined < hi - lo) {
        int n, np = 0, i, base;
        if (dopt__now_ms() >= deadline) {
            dopt__tcp_list(t, lo, hi, 0, missing, sizeof missing);
            if (t->rank != 0)
                return dopt__tcp_setup_fail(c, DOPT_ERR_TIMEOUT, "timed out after %d ms waiting for %s to connect",
                                            t->rdv_timeout_ms, missing);
            return dopt__tcp_setup_fail(c, DOPT_ERR_TIMEOUT, "timed out after %d ms waiting for %s (%d of %d joined)%s%s",
                                        t->rdv_timeout_ms, missing, joined + 1, t->size, t->refusal[0] ? "; refused " : "",
                                        t->refusal);
        }
        if (dopt__tcp_report_due(t)) {
            dopt__tcp_list(t, lo, hi, 0, missing, sizeof missing);
            if (t->rank == 0)
                dopt_comm_log(c, DOPT_LOG_WARN, "rank 0: waiting for %s (%d of %d joined, %d s)", missing, joined + 1,
                              t->size, dopt__tcp_waited_s(t));
            else
                dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: waiting for %s to connect (%d s)", t->rank, missing,
                              dopt__tcp_waited_s(t));
        }
        if (watch_fd >= 0) {
            t->pfd[np].fd = watch_fd;
            t->pfd[np].events = POLLIN;
            t->pfd[np].revents = 0;
            t->pfd_peer[np++] = -1;
        }
        for (r = lo; r < hi && t->rank == 0; r++)
            if (t->peers[r].fd >= 0) {
                t->pfd[np].fd = t->peers[r].fd;
                t->pfd[np].events = POLLIN;
                t->pfd[np].revents = 0;
                t->pfd_peer[np++] = r;
            }
        base = np;
        np = dopt__tcp_lobby_add(c, t, np);
        n = poll(t->pfd, (nfds_t)np, dopt__tcp_setup_ms(t, deadline));
        if (n < 0 && errno == EINTR) continue;
        if (n < 0) return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "poll: %s", strerror(errno));
        if (n == 0) continue;
        for (i = 0; i < base; i++) {
            char b, then[48];
            ssize_t k;
            if (!t->pfd[i].revents) continue;
            if (t->pfd_peer[i] < 0) {
                dopt_status s = dopt__tcp_setup_lost(c, watch_fd, deadline);
                if (s != DOPT_OK) return s;
                continue;
            }
            r = t->pfd_peer[i];
            k = recv(t->peers[r].fd, &b, 1, MSG_DONTWAIT | MSG_PEEK);
            if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
            snprintf(then, sizeof then, "waiting for rank %d again", r);
            dopt__tcp_left_early(c, t, r, k > 0 ? "spoke out of turn" : "closed its connection", then);
            joined--;
        }
        joined += dopt__tcp_lobby_serve(c, t, base, np, lo, hi);
    }
    return DOPT_OK;
}

/* ===================================================================== RENDEZVOUS: RANK 0 AND THE OTHERS */

/* Rank 0: sends every rank WELCOME and the table of everyone's listening address. A rank whose
   connection is gone left before the job formed: AGAIN. */
static dopt_status dopt__tcp_send_tables(dopt_comm *c, dopt__tcp *t, double deadline) {
    size_t table_bytes = DOPT__TCP_HS_BYTES + (size_t)t->size * DOPT__TCP_ENTRY_BYTES;
    unsigned char *table = (unsigned char *)DOPT_MALLOC(table_bytes);
    dopt__tcp_hs h;
    dopt_status s = DOPT_OK;
    int r;
    if (table == NULL) return dopt__tcp_setup_fail(c, DOPT_ERR_NOMEM, "cannot allocate the peer table");
    dopt__tcp_hs_init(&h, t, DOPT__TCP_WELCOME);
    dopt__tcp_hs_encode(table, &h);
    for (r = 0; r < t->size; r++) {
        unsigned char *e = table + DOPT__TCP_HS_BYTES + (size_t)r * DOPT__TCP_ENTRY_BYTES;
        memcpy(e, t->peers[r].addr, 16);
        dopt__put_le16(e + 16, t->peers[r].port);
        dopt__put_le16(e + 18, 0);
    }
    for (r = 1; r < t->size && s == DOPT_OK; r++) {
        char who[24];
        snprintf(who, sizeof who, "rank %d", r);
        s = dopt__tcp_send_all(c, t->peers[r].fd, table, table_bytes, deadline, who);
        if (s == DOPT_ERR_PEER_LOST) {
            dopt__comm_forget_failure(c);
            dopt__tcp_left_early(c, t, r, "closed its connection", "starting the rendezvous over");
            s = DOPT__TCP_RESTART;
        }
    }
    DOPT_FREE(table);
    return s;
}

/* Rank 0: waits for READY from every rank at once. A rank whose connection ends first left
   before the job formed (the others may have the table with its address): AGAIN. The stages,
   not yet used, hold the partial records. Late joiners are refused meanwhile. */
static dopt_status dopt__tcp_gather_ready(dopt_comm *c, dopt__tcp *t, double deadline) {
    char waiting[160];
    int r;
    for (;;) {
        int n, np = 0, i, base;
        if (dopt__tcp_list(t, 1, t->size, 1, waiting, sizeof waiting) == 0) break;
        if (dopt__now_ms() >= deadline)
            return dopt__tcp_setup_fail(c, DOPT_ERR_TIMEOUT,
                                        "timed out after %d ms waiting for %s to connect to the others (all %d joined)",
                                        t->rdv_timeout_ms, waiting, t->size);
        if (dopt__tcp_report_due(t))
            dopt_comm_log(c, DOPT_LOG_WARN, "rank 0: all %d ranks joined; waiting for %s to connect to the others (%d s)",
                          t->size, waiting, dopt__tcp_waited_s(t));
        for (r = 1; r < t->size; r++)
            if (t->peers[r].hi < DOPT__TCP_HS_BYTES) {
                t->pfd[np].fd = t->peers[r].fd;
                t->pfd[np].events = POLLIN;
                t->pfd[np].revents = 0;
                t->pfd_peer[np++] = r;
            }
        base = np;
        np = dopt__tcp_lobby_add(c, t, np);
        n = poll(t->pfd, (nfds_t)np, dopt__tcp_setup_ms(t, deadline));
        if (n < 0 && errno != EINTR) return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "poll: %s", strerror(errno));
        for (i = 0; i < base && n > 0; i++) {
            dopt__tcp_peer *P;
            ssize_t k;
            if (!t->pfd[i].revents) continue;
            r = t->pfd_peer[i];
            P = &t->peers[r];
            k = recv(P->fd, P->hs + P->hi, DOPT__TCP_HS_BYTES - P->hi, MSG_DONTWAIT);
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                dopt__tcp_left_early(c, t, r, "closed its connection", "starting the rendezvous over");
                return DOPT__TCP_RESTART;
            }
            if (k > 0) P->hi += (size_t)k;
            if (P->hi == DOPT__TCP_HS_BYTES) {
                dopt__tcp_hs h;
                const char *why = dopt__tcp_hs_decode(P->hs, &h);
                if (why == NULL && (h.type != DOPT__TCP_READY || h.rank != (uint32_t)r)) why = "not READY";
                if (why)
                    return dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL, "rank %d sent a bad record during setup: %s", r,
                                                why);
            }
        }
        if (n > 0) dopt__tcp_lobby_serve(c, t, base, np, 1, t->size);
    }
    for (r = 0; r < t->size; r++) t->peers[r].hi = 0;
    return DOPT_OK;
}

/* Rank 0, after a rank left before the job formed: tells every other rank to start over (AGAIN)
   and closes their connections; they join again from the start. The listening socket stays. */
static void dopt__tcp_start_over(dopt__tcp *t) {
    unsigned char rec[DOPT__TCP_HS_BYTES], sink[256];
    dopt__tcp_hs h;
    int r;
    dopt__tcp_hs_init(&h, t, DOPT__TCP_AGAIN);
    dopt__tcp_hs_encode(rec, &h);
    for (r = 1; r < t->size; r++) {
        dopt__tcp_peer *P = &t->peers[r];
        if (P->fd < 0) continue;
        (void)!send(P->fd, rec, sizeof rec, MSG_NOSIGNAL | MSG_DONTWAIT);
        shutdown(P->fd, SHUT_WR);
        while (recv(P->fd, sink, sizeof sink, MSG_DONTWAIT) > 0) continue; /* so that close() sends no reset */
        close(P->fd);
        P->fd = -1;
        P->hi = 0;
    }
}

/* Rank 0: listens, admits ranks 1 .. n-1, sends each the table of listening addresses, waits
   until every rank has built its connections (READY) and lets them all go (GO). A rank that
   leaves before that makes the rendezvous start over; the listening socket stays open for the
   communicator's life, so that late joiners are refused instead of finding no one. */
/* RFC 6761: "localhost" and the names under .localhost are this host on every host. */
static int dopt__tcp_is_localhost(const char *host) {
    size_t n = strlen(host);
    if (n > 0 && host[n - 1] == '.') n--;
    return (n == 9 && strncasecmp(host, "localhost", 9) == 0) ||
           (n > 10 && strncasecmp(host + n - 10, ".localhost", 10) == 0);
}

/* 1 when master_addr is a name (not an address, not localhost) that this host resolves to a
   loopback address: the /etc/hosts line "127.0.1.1 node7" of many distributions, while the
   other hosts resolve node7 to this host's real address. */
static int dopt__tcp_loopback_name(const char *master_addr, const unsigned char master[16]) {
    char host[DOPT__TCP_HOST_MAX];
    unsigned char bytes[16];
    int port;
    if (master_addr == NULL || !dopt__tcp_is_loopback(master) ||
        dopt__tcp_split_addr(master_addr, host, sizeof host, &port) != NULL)
        return 0;
    return inet_pton(AF_INET, host, bytes) != 1 && inet_pton(AF_INET6, host, bytes) != 1 &&
           !dopt__tcp_is_localhost(host);
}

/* Rank 0's listening address (addr) and the address it tells the others it has (told), and how
   that was chosen, for messages: where master_addr is, else socket_ifname's choice (IPv4 first),
   else 127.0.0.1; bind_addr, when set, is where it listens, and is told unless it is a wildcard
   (then socket_ifname's choice, of master_addr's family first, is told). A master_addr that is a
   name this host resolves to loopback (dopt__tcp_loopback_name) is listened for everywhere, so
   that the ranks of other hosts, which reach this host by its real address, are answered: with
   the refusal of LOOPBACK, unless socket_ifname gives rank 0 an address to tell them. */
static dopt_status dopt__tcp_root_addr(dopt_comm *c, const dopt_tcp_config *cfg, unsigned char addr[16],
                                       unsigned char told[16], char *how, size_t cap) {
    char ifname[IFNAMSIZ + 1], host[INET6_ADDRSTRLEN];
    const char *ifs = cfg->socket_ifname;
    int wildcard;
    dopt_status s;
    if (cfg->master_addr == NULL && ifs) {
        s = dopt__tcp_ifname_addr(c, ifs, 0, told, ifname, sizeof ifname);
        snprintf(how, cap, "socket_ifname \"%s\": interface %s", ifs, ifname);
    } else {
        s = dopt__tcp_resolve(c, cfg->master_addr ? cfg->master_addr : "127.0.0.1", told);
        dopt__tcp_host_str(told, host, sizeof host);
        if (cfg->master_addr == NULL) snprintf(how, cap, "master_addr unset, so 127.0.0.1");
        else if (dopt__tcp_loopback_name(cfg->master_addr, told))
            snprintf(how, cap, "master_addr \"%s\", which this host resolves to %s", cfg->master_addr, host);
        else snprintf(how, cap, "master_addr \"%s\"", cfg->master_addr);
    }
    memcpy(addr, told, 16);
    if (s != DOPT_OK) return s;
    if (cfg->bind_addr) {
        s = dopt__tcp_resolve(c, cfg->bind_addr, addr);
        wildcard = s == DOPT_OK && dopt__tcp_is_any(addr);
        if (s == DOPT_OK && !wildcard) {
            memcpy(told, addr, 16);
            snprintf(how, cap, "bind_addr \"%s\"", cfg->bind_addr);
        }
    } else {
        wildcard = dopt__tcp_loopback_name(cfg->master_addr, told);
        if (wildcard && dopt__tcp_is_v4(told)) dopt__tcp_set_v4(addr, "\0\0\0\0");
        else if (wildcard) memset(addr, 0, 16);
    }
    if (s == DOPT_OK && wildcard && ifs && cfg->master_addr) {
        s = dopt__tcp_ifname_addr(c, ifs, !dopt__tcp_is_v4(told), told, ifname, sizeof ifname);
        snprintf(how, cap, "socket_ifname \"%s\": interface %s", ifs, ifname);
    }
    return s;
}

/* Rank 0, once every rank joined. A job whose ranks all came over loopback runs on this host,
   where loopback addresses serve it. Once a rank came from another address (another host, as far
   as rank 0 can tell, even when it is this one), the table must hold no loopback address: it
   would tell that host's ranks to connect to themselves (and rank 0's own entry, where it is).
   Then every rank is refused (REFUSE, reason LOOPBACK, naming the rank and its address) and the
   create fails at once, instead of ranks waiting for the rendezvous timeout. `how` says how rank
   0's own address was chosen. */
static dopt_status dopt__tcp_loopback_check(dopt_comm *c, dopt__tcp *t, const char *how) {
    unsigned char rec[DOPT__TCP_HS_BYTES];
    char bad_at[DOPT__TCP_ADDR_CHARS], remote_at[DOPT__TCP_ADDR_CHARS], from[DOPT__TCP_ADDR_CHARS],
        chosen[DOPT__TCP_ADDR_CHARS + 32];
    dopt__tcp_hs h;
    int r, remote = 0, bad = -1;
    for (r = 1; r < t->size && remote == 0; r++)
        if (!dopt__tcp_is_loopback(t->peers[r].from)) remote = r;
    for (r = 0; r < t->size && remote && bad < 0; r++)
        if (dopt__tcp_is_loopback(t->peers[r].addr)) bad = r;
    if (bad < 0) return DOPT_OK;
    dopt__tcp_hs_init(&h, t, DOPT__TCP_REFUSE);
    h.reason = DOPT__TCP_LOOPBACK;
    h.subject = (uint32_t)bad;
    memcpy(h.addr, t->peers[bad].addr, 16);
    h.port = t->peers[bad].port;
    dopt__tcp_hs_encode(rec, &h);
    for (r = 1; r < t->size; r++) (void)!send(t->peers[r].fd, rec, sizeof rec, MSG_NOSIGNAL | MSG_DONTWAIT);
    dopt__tcp_addr_str(t->peers[bad].addr, t->peers[bad].port, bad_at, sizeof bad_at);
    dopt__tcp_addr_str(t->peers[remote].from, t->peers[remote].from_port, remote_at, sizeof remote_at);
    dopt__tcp_addr_str(t->peers[bad].from, t->peers[bad].from_port, from, sizeof from);
    snprintf(chosen, sizeof chosen, "it joined from %s", from);
    return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID,
                                "rank %d would be reached at %s (%s): a loopback address, where other hosts cannot "
                                "reach it, and rank %d joined from %s, which is not one (another host, as far as rank "
                                "0 can tell); %s",
                                bad, bad_at, bad == 0 ? how : chosen, remote, remote_at, DOPT__TCP_LOOPBACK_ADVICE);
}

static dopt_status dopt__tcp_rendezvous_root(dopt_comm *c, dopt__tcp *t, const dopt_tcp_config *cfg,
                                             uint32_t master_port, double deadline) {
    unsigned char addr[16];
    char how[DOPT__TCP_HOST_MAX + 64];
    uint32_t port;
    int r;
    dopt_status s = dopt__tcp_root_addr(c, cfg, addr, t->peers[0].addr, how, sizeof how);
    if (s == DOPT_OK) s = dopt__tcp_listen(c, t, addr, master_port, &t->lfd, &port);
    if (s != DOPT_OK) return s;
    t->peers[0].port = port;
    if (cfg->on_listen) cfg->on_listen(cfg->on_listen_user, (int)port);
    for (;;) {
        s = dopt__tcp_admit(c, t, 1, t->size, deadline, -1);
        if (s == DOPT_OK) s = dopt__tcp_loopback_check(c, t, how);
        if (s == DOPT_OK) s = dopt__tcp_send_tables(c, t, deadline);
        if (s == DOPT_OK) s = dopt__tcp_gather_ready(c, t, deadline);
        if (s != DOPT__TCP_RESTART) break;
        dopt__tcp_start_over(t);
    }
    for (r = 1; r < t->size && s == DOPT_OK; r++) {
        char who[24];
        snprintf(who, sizeof who, "rank %d", r);
        s = dopt__tcp_send_record(c, t, t->peers[r].fd, DOPT__TCP_GO, deadline, who);
    }
    return s;
}

/* Rank k > 0, after a connection to another rank failed while building them: that rank may have
   been told to start over, or have died (rank 0 sees it too). Rank 0's word decides, if it comes
   within DOPT__TCP_VERDICT_MS: AGAIN, or the failure stands. */
static dopt_status dopt__tcp_verdict(dopt_comm *c, int fd0, double deadline, dopt_status s) {
    double until = dopt__now_ms() + DOPT__TCP_VERDICT_MS;
    struct pollfd pf;
    if (until > deadline) until = deadline;
    pf.fd = fd0;
    pf.events = POLLIN;
    pf.revents = 0;
    if (poll(&pf, 1, dopt__ms_left(until)) > 0 && dopt__tcp_setup_lost(c, fd0, until) == DOPT__TCP_RESTART) {
        dopt__comm_forget_failure(c);
        return DOPT__TCP_RESTART;
    }
    return s;
}

/* Rank k > 0, about to listen on addr (chosen as `how` says) and tell the others to connect there.
   When it reaches rank 0 at a loopback address, so do all (rank 0 refuses the job otherwise:
   dopt__tcp_loopback_check), and a loopback addr serves. When it reaches rank 0 at another
   address, ranks may run on other hosts, which a loopback addr would send to themselves. */
static dopt_status dopt__tcp_loopback_told(dopt_comm *c, const unsigned char master[16], const unsigned char addr[16],
                                           const char *who, const char *how) {
    char host[INET6_ADDRSTRLEN];
    if (!dopt__tcp_is_loopback(addr) || dopt__tcp_is_loopback(master)) return DOPT_OK;
    dopt__tcp_host_str(addr, host, sizeof host);
    return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID,
                                "this rank would be reached at %s (%s): a loopback address, where other hosts cannot "
                                "reach it, and it reaches %s, which is not one (ranks may run on other hosts); give "
                                "it an address other hosts reach: DOPT_SOCKET_IFNAME=<interface> or "
                                "DOPT_BIND_ADDR=<address> (or, when every rank runs on this host, "
                                "DOPT_MASTER_ADDR=127.0.0.1)",
                                host, how, who);
}

/* Where rank k > 0 listens and is reached (INTERFACES), held to LOOPBACK's rule: bind_addr, else
   socket_ifname's choice (of the master address's family first), both known before it connects
   (fd0 < 0), so that a bad one fails at once; else, once connected (fd0), the local address of
   its connection to rank 0. */
static dopt_status dopt__tcp_rank_addr(dopt_comm *c, const dopt_tcp_config *cfg, const unsigned char master[16],
                                       int fd0, const char *who, unsigned char addr[16]) {
    char how[DOPT__TCP_HOST_MAX + 32], ifname[IFNAMSIZ + 1];
    struct sockaddr_storage ss;
    socklen_t len = sizeof ss;
    uint32_t port;
    dopt_status s = DOPT_OK;
    if (cfg->bind_addr) {
        s = dopt__tcp_resolve(c, cfg->bind_addr, addr);
        snprintf(how, sizeof how, "bind_addr \"%s\"", cfg->bind_addr);
    } else if (cfg->socket_ifname) {
        s = dopt__tcp_ifname_addr(c, cfg->socket_ifname, !dopt__tcp_is_v4(master), addr, ifname, sizeof ifname);
        snprintf(how, sizeof how, "socket_ifname \"%s\": interface %s", cfg->socket_ifname, ifname);
    } else if (fd0 < 0) {
        return DOPT_OK;
    } else if (getsockname(fd0, (struct sockaddr *)&ss, &len) < 0 || dopt__tcp_from_sockaddr(&ss, addr, &port) < 0) {
        return dopt__tcp_setup_fail(c, DOPT_ERR_IO, "getsockname: %s", strerror(errno));
    } else {
        snprintf(how, sizeof how, "the interface that reaches rank 0");
    }
    return s == DOPT_OK ? dopt__tcp_loopback_told(c, master, addr, who, how) : s;
}

/* Rank k > 0, one attempt: joins rank 0, learns the others' addresses, connects to ranks
   1 .. k-1, accepts ranks k+1 .. n-1, then reports READY and waits for GO. Every wait also
   watches the connection to rank 0, which carries AGAIN when the rendezvous starts over and
   ends when rank 0 fails. */
static dopt_status dopt__tcp_join(dopt_comm *c, dopt__tcp *t, const dopt_tcp_config *cfg,
                                  const unsigned char master[16], uint32_t master_port, double deadline) {
    unsigned char bind_addr[16], *table = NULL;
    size_t table_bytes = (size_t)t->size * DOPT__TCP_ENTRY_BYTES;
    char who[32 + DOPT__TCP_ADDR_CHARS], where[DOPT__TCP_ADDR_CHARS], what[64 + sizeof who];
    int fd0 = -1, r;
    uint32_t port;
    dopt__tcp_hs h;
    dopt_status s;
    dopt__tcp_addr_str(master, master_port, where, sizeof where);
    snprintf(who, sizeof who, "rank 0 at %s", where);
    s = dopt__tcp_rank_addr(c, cfg, master, -1, who, bind_addr);
    if (s == DOPT_OK) s = dopt__tcp_connect(c, t, master, master_port, deadline, -1, who, &fd0);
    if (s != DOPT_OK) return s;
    t->peers[0].fd = fd0;
    if (cfg->bind_addr == NULL && cfg->socket_ifname == NULL) /* the interface that reaches rank 0 */
        s = dopt__tcp_rank_addr(c, cfg, master, fd0, who, bind_addr);
    if (s == DOPT_OK) s = dopt__tcp_listen(c, t, bind_addr, (uint32_t)cfg->listen_port, &t->lfd, &port);
    if (s == DOPT_OK) s = dopt__tcp_hello(c, t, fd0, 0, bind_addr, port, deadline, -1, who);
    snprintf(what, sizeof what, "the other ranks to join %s", who);
    if (s == DOPT_OK) s = dopt__tcp_recv_record(c, t, fd0, 0, DOPT__TCP_WELCOME, deadline, who, what, &h);
    if (s == DOPT_OK && (table = (unsigned char *)DOPT_MALLOC(table_bytes)) == NULL)
        s = dopt__tcp_setup_fail(c, DOPT_ERR_NOMEM, "cannot allocate the peer table");
    if (s == DOPT_OK) s = dopt__tcp_recv_all(c, fd0, table, table_bytes, deadline, -1, who, what);
    for (r = 0; r < t->size && s == DOPT_OK; r++) {
        const char *why = dopt__tcp_entry_decode(table + (size_t)r * DOPT__TCP_ENTRY_BYTES, t->peers[r].addr,
                                                 &t->peers[r].port);
        if (why) s = dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL, "rank 0's peer table entry %d: %s", r, why);
    }
    DOPT_FREE(table);
    if (s != DOPT_OK) return s;
    for (r = 1; r < t->rank && s == DOPT_OK; r++) {
        int fd = -1;
        dopt__tcp_addr_str(t->peers[r].addr, t->peers[r].port, where, sizeof where);
        snprintf(who, sizeof who, "rank %d at %s", r, where);
        s = dopt__tcp_connect(c, t, t->peers[r].addr, t->peers[r].port, deadline, fd0, who, &fd);
        if (s != DOPT_OK) break;
        t->peers[r].fd = fd;
        s = dopt__tcp_hello(c, t, fd, r, bind_addr, port, deadline, fd0, who);
    }
    if (s == DOPT_OK) s = dopt__tcp_admit(c, t, t->rank + 1, t->size, deadline, fd0);
    if (s == DOPT_ERR_PEER_LOST) s = dopt__tcp_verdict(c, fd0, deadline, s);
    if (s != DOPT_OK) return s;
    if (t->on_peer_lost == DOPT_SHRINK) /* the survivors' agreement connects here (SHRINK) */
        t->shrink_lfd = t->lfd;
    else
        close(t->lfd);
    t->lfd = -1;
    s = dopt__tcp_send_record(c, t, fd0, DOPT__TCP_READY, deadline, "rank 0");
    if (s == DOPT_OK)
        s = dopt__tcp_recv_record(c, t, fd0, 0, DOPT__TCP_GO, deadline, "rank 0",
                                  "rank 0's go (the other ranks are still connecting to each other)", &h);
    return s;
}

/* Closes every connection and the listening socket: what a rank does before joining again. */
static void dopt__tcp_close_all(dopt__tcp *t) {
    int r;
    for (r = 0; r < t->size; r++)
        if (t->peers[r].fd >= 0) {
            close(t->peers[r].fd);
            t->peers[r].fd = -1;
        }
    if (t->lfd >= 0) close(t->lfd);
    t->lfd = -1;
    if (t->shrink_lfd >= 0) close(t->shrink_lfd);
    t->shrink_lfd = -1;
    for (r = 0; r < t->npend; r++) close(t->pend[r].fd);
    t->npend = 0;
}

/* Rank k > 0: joins until the job forms, again from the start each time rank 0 says AGAIN. */
static dopt_status dopt__tcp_rendezvous_rank(dopt_comm *c, dopt__tcp *t, const dopt_tcp_config *cfg,
                                             uint32_t master_port, double deadline) {
    unsigned char master[16];
    dopt_status s = dopt__tcp_resolve(c, cfg->master_addr ? cfg->master_addr : "127.0.0.1", master);
    if (s != DOPT_OK) return s;
    for (;;) {
        s = dopt__tcp_join(c, t, cfg, master, master_port, deadline);
        if (s != DOPT__TCP_RESTART) return s;
        dopt__tcp_close_all(t);
        dopt_comm_log(c, DOPT_LOG_WARN,
                      "rank %d: rank 0 started the rendezvous over (a rank left before the job formed); joining again",
                      t->rank);
    }
}

/* ===================================================================== CREATE */

static dopt_status dopt__tcp_config_error(const dopt_tcp_config *cfg, const char *fmt, ...) DOPT_PRINTF(2, 3);
static dopt_status dopt__tcp_config_error(const dopt_tcp_config *cfg, const char *fmt, ...) {
    char why[DOPT_DETAIL_MAX / 2], msg[DOPT_DETAIL_MAX];
    va_list ap;
    if (cfg && cfg->log_fn) {
        va_start(ap, fmt);
        vsnprintf(why, sizeof why, fmt, ap);
        va_end(ap);
        snprintf(msg, sizeof msg, "tcp: invalid configuration: %s", why);
        cfg->log_fn(cfg->log_user, DOPT_LOG_ERROR, msg);
    }
    return DOPT_ERR_INVALID;
}

/* Validates cfg and makes the communicator with its state, no connection yet. */
static dopt_status dopt__tcp_new(dopt_comm **out, const dopt_tcp_config *cfg) {
    dopt__tcp *t;
    dopt_comm *c;
    size_t toklen;
    dopt_status s;
    int p;
    if (out == NULL || cfg == NULL) return dopt__tcp_config_error(cfg, "NULL argument");
    *out = NULL;
    if (cfg->world_size < 1) return dopt__tcp_config_error(cfg, "world_size %d is below 1", cfg->world_size);
    if (cfg->rank < 0 || cfg->rank >= cfg->world_size)
        return dopt__tcp_config_error(cfg, "rank %d is outside 0..%d", cfg->rank, cfg->world_size - 1);
    if (cfg->master_port < 0 || cfg->master_port > 65535)
        return dopt__tcp_config_error(cfg, "master_port %d is outside 0..65535", cfg->master_port);
    toklen = cfg->token ? strlen(cfg->token) : 0;
    if (toklen > DOPT_TCP_TOKEN_MAX)
        return dopt__tcp_config_error(cfg, "the token is %lu bytes, more than DOPT_TCP_TOKEN_MAX (%d)",
                                      (unsigned long)toklen, DOPT_TCP_TOKEN_MAX);
    if (cfg->socket_buffer_bytes < 0)
        return dopt__tcp_config_error(cfg, "socket_buffer_bytes %d is negative", cfg->socket_buffer_bytes);
    if (cfg->on_peer_lost != DOPT_FAIL && cfg->on_peer_lost != DOPT_SHRINK)
        return dopt__tcp_config_error(cfg, "on_peer_lost is %d, not DOPT_FAIL (0) or DOPT_SHRINK (1)", cfg->on_peer_lost);
    if (cfg->min_ranks < 0 || cfg->min_ranks > cfg->world_size)
        return dopt__tcp_config_error(cfg, "min_ranks %d is outside 0..world_size (%d)", cfg->min_ranks,
                                      cfg->world_size);
    if (cfg->listen_port < 0 || cfg->listen_port > 65535)
        return dopt__tcp_config_error(cfg, "listen_port %d is outside 0..65535", cfg->listen_port);
    if (cfg->keepalive_s > DOPT__TCP_KEEPALIVE_MAX_S)
        return dopt__tcp_config_error(cfg, "keepalive_s %d is above %d (the kernel's limit); negative turns it off",
                                      cfg->keepalive_s, DOPT__TCP_KEEPALIVE_MAX_S);
    if (cfg->dead_after_ms < 0 || (cfg->dead_after_ms > 0 && cfg->dead_after_ms < DOPT__TCP_HB_MIN_MS))
        return dopt__tcp_config_error(cfg, "dead_after_ms %d is not 0 (off) or at least %d (a heartbeat every tenth "
                                      "of it)", cfg->dead_after_ms, DOPT__TCP_HB_MIN_MS);
#ifndef DOPT__THREADS
    if (cfg->dead_after_ms > 0)
        return dopt__tcp_config_error(cfg, "dead_after_ms needs a thread, and this build has none (DOPT_NO_THREADS)");
#endif
    t = (dopt__tcp *)DOPT_MALLOC(sizeof *t);
    if (t == NULL) goto nomem;
    memset(t, 0, sizeof *t);
    t->rank = cfg->rank;
    t->size = cfg->world_size;
    t->lfd = -1;
    t->shrink_lfd = -1;
    t->on_peer_lost = cfg->on_peer_lost;
    t->two_level = cfg->two_level;
    t->progress_thread_us = cfg->progress_thread_us;
    t->keepalive_s = cfg->keepalive_s == 0 ? 1 : cfg->keepalive_s;
    t->dead_after_ms = cfg->dead_after_ms;
    t->spin_us = cfg->spin_us;
    t->small_bytes = cfg->small_bytes;
    t->sockbuf = cfg->socket_buffer_bytes;
    t->rdv_timeout_ms = cfg->rendezvous_timeout_ms > 0 ? cfg->rendezvous_timeout_ms : DOPT__TCP_RENDEZVOUS_DEFAULT_MS;
    t->report_ms = cfg->rendezvous_report_ms == 0 ? DOPT__TCP_REPORT_DEFAULT_MS : cfg->rendezvous_report_ms;
    if (toklen) memcpy(t->token, cfg->token, toklen);
    t->peers = (dopt__tcp_peer *)DOPT_MALLOC(sizeof(dopt__tcp_peer) * (size_t)t->size);
    /* peers, then the listening socket, a watched connection and the connections not admitted yet */
    t->pfd = (struct pollfd *)DOPT_MALLOC(sizeof(struct pollfd) * ((size_t)t->size + DOPT__TCP_MAX_PENDING + DOPT__TCP_MAX_JOINERS + 2));
    t->pfd_peer = (int *)DOPT_MALLOC(sizeof(int) * ((size_t)t->size + DOPT__TCP_MAX_PENDING + DOPT__TCP_MAX_JOINERS + 2));
    if (t->peers) memset(t->peers, 0, sizeof(dopt__tcp_peer) * (size_t)t->size);
    for (p = 0; t->peers && p < t->size; p++) t->peers[p].fd = -1;
    if (!t->peers || !t->pfd || !t->pfd_peer) {
        dopt__tcp_free(t);
        goto nomem;
    }
    s = dopt_comm_new(&c, t->rank, t->size, &dopt__tcp_vtable, t);
    if (s != DOPT_OK) {
        dopt__tcp_free(t);
        goto nomem;
    }
    c->log_fn = cfg->log_fn;
    c->log_user = cfg->log_user;
    c->on_peer_lost = cfg->on_peer_lost;
    c->min_ranks = cfg->min_ranks;
    if (cfg->timeout_ms > 0) c->timeout_ms = cfg->timeout_ms;
    dopt_comm_set_engine(c, cfg->small_bytes, cfg->spin_us);
    *out = c;
    return DOPT_OK;
nomem:
    if (cfg->log_fn) cfg->log_fn(cfg->log_user, DOPT_LOG_ERROR, "tcp: cannot allocate a communicator's state");
    return DOPT_ERR_NOMEM;
}

DOPT_DEF dopt_status dopt_tcp_create_from_sockets(dopt_comm **out, const int *fds, const dopt_tcp_config *cfg) {
    dopt_comm *c = NULL;
    dopt__tcp *t;
    int p;
    dopt_status s;
    if (out == NULL) return dopt__tcp_config_error(cfg, "NULL out");
    *out = NULL;
    s = dopt__tcp_new(&c, cfg);
    if (s != DOPT_OK || fds == NULL) {
        for (p = 0; fds && cfg && p < cfg->world_size; p++)
            if (p != cfg->rank && fds[p] >= 0) close(fds[p]);
        dopt_comm_destroy(c);
        return s != DOPT_OK ? s : dopt__tcp_config_error(cfg, "NULL fds");
    }
    t = (dopt__tcp *)c->impl;
    for (p = 0; p < t->size; p++)
        if (p != t->rank) t->peers[p].fd = fds[p];
    for (p = 0; p < t->size; p++) {
        if (p == t->rank) continue;
        if (t->peers[p].fd < 0 || dopt__tcp_set_nonblocking(t->peers[p].fd) < 0) {
            s = dopt_comm_fail(c, NULL, DOPT_ERR_INVALID, "the socket for rank %d is not usable", p);
            dopt_comm_destroy(c);
            return s;
        }
        dopt__tcp_tune(t->peers[p].fd, 0); /* TCP_NODELAY where it applies */
        dopt__tcp_keepalive(t->peers[p].fd, t->keepalive_s);
    }
    t->ready = 1;
    *out = c;
    return DOPT_OK;
}

/* Ranks whose rendezvous address is this rank's: on one host, as far as the table can tell. */
static int dopt__tcp_local_ranks(const dopt__tcp *t) {
    int r, n = 0;
    for (r = 0; r < t->size; r++) n += memcmp(t->peers[r].addr, t->peers[t->rank].addr, 16) == 0;
    return n;
}

/* No rank below r has r's rendezvous address: r is the first of its host. */
static int dopt__tcp_first_of_host(const dopt__tcp *t, int r) {
    int q;
    for (q = 0; q < r; q++)
        if (memcmp(t->peers[q].addr, t->peers[r].addr, 16) == 0) return 0;
    return 1;
}

/* "H hosts (ranks per host a,b,...)", hosts in the order of their lowest rank, for the log. */
static void dopt__tcp_hosts_str(const dopt__tcp *t, char *out, size_t cap) {
    int r, q, n, hosts = 0, shown = 0;
    size_t used;
    for (r = 0; r < t->size; r++) hosts += dopt__tcp_first_of_host(t, r);
    used = (size_t)snprintf(out, cap, "%d host%s (ranks per host ", hosts, hosts == 1 ? "" : "s");
    for (r = 0; r < t->size && shown < hosts && used + 16 < cap; r++) {
        if (!dopt__tcp_first_of_host(t, r)) continue;
        for (q = r, n = 0; q < t->size; q++) n += memcmp(t->peers[q].addr, t->peers[r].addr, 16) == 0;
        used += (size_t)snprintf(out + used, cap - used, "%s%d", shown++ ? "," : "", n);
    }
    snprintf(out + used, cap - used, "%s)", shown < hosts ? ",..." : "");
}

/* The engine's host table: ranks whose rendezvous address is the same share a host. */
static dopt_status dopt__tcp_set_hosts(dopt_comm *c, const dopt__tcp *t, int two_level) {
    int *host_of = (int *)DOPT_MALLOC(sizeof(int) * (size_t)t->size), r, q;
    dopt_status s;
    if (host_of == NULL) return DOPT_ERR_NOMEM;
    for (r = 0; r < t->size; r++)
        for (q = 0, host_of[r] = r; q < r; q++)
            if (memcmp(t->peers[q].addr, t->peers[r].addr, 16) == 0) {
                host_of[r] = q;
                break;
            }
    s = dopt_comm_set_hosts(c, host_of, two_level);
    DOPT_FREE(host_of);
    return s;
}

/* master_addr and bind_addr as written (dopt__tcp_split_addr's forms), socket_ifname naming
   something; *port: rank 0's port, from
   master_addr when it has one (master_port, when set too, must say the same), else master_port. */
static dopt_status dopt__tcp_check_addrs(const dopt_tcp_config *cfg, int *port) {
    char host[DOPT__TCP_HOST_MAX];
    const char *why;
    int attached;
    *port = cfg->master_port;
    if (cfg->master_addr) {
        why = dopt__tcp_split_addr(cfg->master_addr, host, sizeof host, &attached);
        if (why) return dopt__tcp_config_error(cfg, "master_addr \"%s\" %s", cfg->master_addr, why);
        if (attached && cfg->master_port && attached != cfg->master_port)
            return dopt__tcp_config_error(cfg, "master_addr \"%s\" names port %d but master_port is %d",
                                          cfg->master_addr, attached, cfg->master_port);
        if (attached) *port = attached;
    }
    if (cfg->bind_addr) {
        why = dopt__tcp_split_addr(cfg->bind_addr, host, sizeof host, &attached);
        if (why == NULL && attached) why = "has a port (rank 0 listens on master_port, the others on a free one)";
        if (why) return dopt__tcp_config_error(cfg, "bind_addr \"%s\" %s", cfg->bind_addr, why);
    }
    if (cfg->socket_ifname && !dopt__tcp_ifname_valid(cfg->socket_ifname))
        return dopt__tcp_config_error(cfg, "socket_ifname \"%s\" names no interface", cfg->socket_ifname);
    return DOPT_OK;
}

/* The job's identity for the flight recorder: the token, rank 0's address and the epoch, alike on
   every rank (a world of one adds its process, so two of them never share a file; a shrunk
   communicator's epoch keeps its files apart from those of the one it replaces). */
static void dopt__tcp_set_job(dopt_comm *c, const dopt__tcp *t) {
    unsigned char id[DOPT_TCP_TOKEN_MAX + 16 + 8];
    memcpy(id, t->token, DOPT_TCP_TOKEN_MAX);
    memcpy(id + DOPT_TCP_TOKEN_MAX, t->peers[0].addr, 16);
    dopt__put_le32(id + DOPT_TCP_TOKEN_MAX + 16, t->peers[0].port);
    dopt__put_le32(id + DOPT_TCP_TOKEN_MAX + 20, t->size == 1 ? (uint32_t)getpid() : c->epoch);
    dopt_comm_set_job(c, id, sizeof id);
}

DOPT_DEF dopt_status dopt_tcp_create(dopt_comm **out, const dopt_tcp_config *cfg) {
    dopt_comm *c = NULL;
    dopt__tcp *t;
    double deadline;
    dopt_status s;
    int port, p;
    dopt_tcp_config named;
    if (out == NULL) return dopt__tcp_config_error(cfg, "NULL out");
    *out = NULL;
    if (cfg && cfg->master_addr == NULL && cfg->master_host[0]) { /* the name config_from_env derived */
        named = *cfg;
        named.master_addr = named.master_host;
        cfg = &named;
    }
    if (cfg && cfg->join) { /* RE-ADMIT: the rank and size are the job's to give */
        s = dopt__tcp_check_addrs(cfg, &port);
        if (s == DOPT_OK && port == 0) s = dopt__tcp_config_error(cfg, "a joiner needs rank 0's port (master_port)");
        return s == DOPT_OK ? dopt__tcp_join_job(out, cfg, port) : s;
    }
    s = dopt__tcp_new(&c, cfg);
    if (s == DOPT_OK && (s = dopt__tcp_check_addrs(cfg, &port)) == DOPT_OK &&
        (cfg->two_level < DOPT_TWO_LEVEL_OFF || cfg->two_level > DOPT_TWO_LEVEL_ON))
        s = dopt__tcp_config_error(cfg, "two_level is %d, not DOPT_TWO_LEVEL_AUTO (0), _ON (1) or _OFF (-1)",
                                   cfg->two_level);
    if (s != DOPT_OK && c) dopt_comm_destroy(c);
    if (s != DOPT_OK) return s;
    t = (dopt__tcp *)c->impl;
    t->setup_start = dopt__now_ms();
    t->next_report = t->setup_start + t->report_ms;
    deadline = t->setup_start + (double)t->rdv_timeout_ms;
    if (t->size > 1) {
        if (cfg->rank != 0 && port == 0)
            s = dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "master_port is needed on every rank but 0");
        else if (t->rank == 0)
            s = dopt__tcp_rendezvous_root(c, t, cfg, (uint32_t)port, deadline);
        else
            s = dopt__tcp_rendezvous_rank(c, t, cfg, (uint32_t)port, deadline);
    }
    if (s != DOPT_OK) {
        dopt_comm_log(c, DOPT_LOG_ERROR, "%s", c->detail); /* the one line that says why */
        dopt_comm_destroy(c);
        return s;
    }
    t->ready = 1;
    for (p = 0; p < t->size; p++) dopt__tcp_keepalive(t->peers[p].fd, t->keepalive_s);
    dopt__tcp_set_job(c, t);
    if ((s = dopt__tcp_hb_take(c, t, NULL)) != DOPT_OK) {
        dopt_comm_log(c, DOPT_LOG_ERROR, "%s", c->detail);
        dopt_comm_destroy(c);
        return s;
    }
    dopt_comm_set_host(c, t->size == 1 ? 1 : dopt__tcp_local_ranks(t), (int)sysconf(_SC_NPROCESSORS_ONLN));
    if (dopt__tcp_set_hosts(c, t, cfg->two_level) != DOPT_OK) {
        dopt_comm_destroy(c);
        return dopt__tcp_config_error(cfg, "cannot allocate the host table");
    }
    if (t->size == 1) {
        dopt_comm_log(c, DOPT_LOG_INFO, "tcp rank 0 of 1: a world of one, no sockets");
    } else {
        char where[DOPT__TCP_ADDR_CHARS], hosts[160];
        dopt__tcp_addr_str(t->peers[0].addr, t->peers[0].port, where, sizeof where);
        dopt__tcp_hosts_str(t, hosts, sizeof hosts);
        dopt_comm_log(c, DOPT_LOG_INFO, "tcp rank %d of %d: rendezvous at %s, %s", t->rank, t->size, where, hosts);
    }
    if (cfg->progress_thread_us > 0 && (s = dopt_comm_set_progress_thread(c, cfg->progress_thread_us)) != DOPT_OK) {
        dopt_comm_destroy(c);
        return dopt__tcp_config_error(cfg, "cannot start the progress thread: %s", dopt_status_str(s));
    }
    *out = c;
    return DOPT_OK;
}

/* The config of a communicator that takes over t's settings, as rank `rank` of `size`. */
static void dopt__tcp_like(const dopt_comm *c, const dopt__tcp *t, int rank, int size, char token[DOPT_TCP_TOKEN_MAX + 1],
                           dopt_tcp_config *k) {
    memset(k, 0, sizeof *k);
    memcpy(token, t->token, DOPT_TCP_TOKEN_MAX);
    token[DOPT_TCP_TOKEN_MAX] = '\0';
    k->rank = rank;
    k->world_size = size;
    k->timeout_ms = c->timeout_ms;
    k->token = token;
    k->socket_buffer_bytes = t->sockbuf;
    k->small_bytes = t->small_bytes;
    k->spin_us = t->spin_us;
    k->log_fn = c->log_fn;
    k->log_user = c->log_user;
    k->on_peer_lost = DOPT_SHRINK;
    k->min_ranks = c->min_ranks;
    k->keepalive_s = t->keepalive_s;
    k->dead_after_ms = t->dead_after_ms;
    k->two_level = t->two_level;
    k->progress_thread_us = t->progress_thread_us;
}

/* A link that has ended, for a rank no connection was made with: the first collective on the
   grown communicator names that rank, and a shrink leaves it out. */
static int dopt__tcp_ended_link(void) {
    int pair[2];
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, pair) < 0) return -1;
    close(pair[1]);
    return pair[0];
}

/* ===================================================================== SHRINK: THE SURVIVORS AGREE

   dopt_comm_shrink on a TCP communicator configured with DOPT_SHRINK (manual: SURVIVING A LOST
   RANK; the rules: engine.h, SHRINK: THE SURVIVORS' AGREEMENT). Every rank but 0 kept the socket
   it listened on at the rendezvous. Each survivor connects to every rank above it that it does
   not know to be gone, says who it is in a 40-byte hello, and once it has decided writes its
   decision (a set of ranks gone) on each of those connections; it reads the decision of every
   rank below it from the connection that rank made. Gone: a connection that ends or is refused;
   a rank below that has not connected when its old link ends (after a grace for its connection
   to arrive); a rank below that said nothing for the timeout. The connection between two
   members, after the hello and the lower rank's decision, is their link in the next
   communicator: nothing else is ever written on it before the engine's frames. */

#define DOPT__TCP_SHRINK_VERSION 1
#define DOPT__TCP_SHRINK_GRACE_MS 200 /* a rank below whose old link ended may still be connecting */

typedef struct dopt__tcp_shrinker {
    dopt__agree a;
    int *fd;          /* the agreement connection with each rank (-1: none) */
    int *state;       /* below: 0 awaited, 1 hello read, 2 decision read; above: 0 none, 1 connecting,
                         2 hello written; -1 gone */
    double *ended;    /* a rank below whose old link ended, when (0: not) */
    unsigned char *rbuf; /* a decision being read from each rank below: msg bytes each */
    size_t *got;
    size_t msg;       /* a decision's bytes: 8 + 8 * words */
    int pend[DOPT__TCP_MAX_PENDING]; /* accepted, hello not read yet */
    unsigned char pbuf[DOPT__TCP_MAX_PENDING][DOPT__TCP_SHRINK_HELLO];
    size_t pgot[DOPT__TCP_MAX_PENDING];
    int npend;
} dopt__tcp_shrinker;

/* The hello's proof that its sender holds the job's token, without the token on the wire: a
   keyed 64-bit hash of (token, epoch, size, from, to) — not a cryptographic MAC (see SURVIVING A
   LOST RANK). */
static uint64_t dopt__tcp_shrink_proof(const dopt__tcp *t, uint32_t epoch, int n, int from, int to) {
    unsigned char f[16];
    uint64_t h = dopt__fnv1a(DOPT__FNV_OFFSET, "distopt shrink", 14);
    h = dopt__fnv1a(h, t->token, DOPT_TCP_TOKEN_MAX);
    dopt__put_le32(f, epoch);
    dopt__put_le32(f + 4, (uint32_t)n);
    dopt__put_le32(f + 8, (uint32_t)from);
    dopt__put_le32(f + 12, (uint32_t)to);
    h = dopt__fnv1a(h, f, sizeof f);
    return dopt__fnv1a(h, t->token, DOPT_TCP_TOKEN_MAX); /* the token again, after the fields */
}

static void dopt__tcp_shrink_hello(unsigned char *out, const dopt__tcp *t, uint32_t epoch, int from, int to) {
    memset(out, 0, DOPT__TCP_SHRINK_HELLO);
    memcpy(out, "DSHR", 4);
    dopt__put_le32(out + 4, DOPT__TCP_SHRINK_VERSION);
    dopt__put_le32(out + 8, epoch);
    dopt__put_le32(out + 12, (uint32_t)t->size);
    dopt__put_le32(out + 16, (uint32_t)from);
    dopt__put_le32(out + 20, (uint32_t)to);
    dopt__put_le64(out + 24, dopt__tcp_shrink_proof(t, epoch, t->size, from, to));
}

/* The rank below that sent this hello, or -1 (with the reason logged) when it is not one. */
static int dopt__tcp_shrink_check_hello(dopt_comm *c, const dopt__tcp *t, const unsigned char *in) {
    uint32_t version = dopt__get_le32(in + 4), epoch = dopt__get_le32(in + 8), n = dopt__get_le32(in + 12);
    uint32_t from = dopt__get_le32(in + 16), to = dopt__get_le32(in + 20);
    const char *why = NULL;
    if (memcmp(in, "DSHR", 4) != 0)
        why = "not a survivor's hello";
    else if (version != DOPT__TCP_SHRINK_VERSION)
        why = "another version of the agreement";
    else if (epoch != c->epoch || n != (uint32_t)t->size)
        why = "another communicator of the job (epoch or size differs)";
    else if (to != (uint32_t)t->rank || from >= (uint32_t)t->rank)
        why = "ranks that do not fit";
    else if (dopt__get_le64(in + 24) != dopt__tcp_shrink_proof(t, epoch, t->size, (int)from, (int)to))
        why = "the wrong job token";
    if (why) {
        dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: dopt_comm_shrink: refused a connection: %s", t->rank, why);
        return -1;
    }
    return (int)from;
}

/* A hello for a shrink of this communicator or of one a grow now being made will be (a rank
   done with the grow before this one: its size is not known here yet), its proof right; 0 with
   the reason logged when it is not one. */
static int dopt__tcp_shrink_hello_later(dopt_comm *c, const dopt__tcp *t, const unsigned char *in) {
    uint32_t epoch = dopt__get_le32(in + 8), n = dopt__get_le32(in + 12), from = dopt__get_le32(in + 16);
    if (epoch == c->epoch) return dopt__tcp_shrink_check_hello(c, t, in) >= 0;
    if (memcmp(in, "DSHR", 4) == 0 && dopt__get_le32(in + 4) == DOPT__TCP_SHRINK_VERSION && epoch == c->epoch + 1 &&
        n > (uint32_t)t->size && n <= DOPT__TCP_MAX_GROWN && dopt__get_le32(in + 20) == (uint32_t)t->rank &&
        from < (uint32_t)t->rank && dopt__get_le64(in + 24) == dopt__tcp_shrink_proof(t, epoch, (int)n, (int)from, t->rank))
        return 1;
    dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: refused a survivor's hello: not for this communicator or the next", t->rank);
    return 0;
}

static void dopt__tcp_shrink_gone(dopt_comm *c, dopt__tcp_shrinker *z, int r, const char *why) {
    if (z->state[r] == -1) return;
    if (z->fd[r] >= 0) close(z->fd[r]);
    z->fd[r] = -1;
    z->state[r] = -1;
    dopt__agree_lost(&z->a, r);
    dopt_comm_log(c, DOPT_LOG_INFO, "rank %d: dopt_comm_shrink: rank %d is gone (%s)", c->rank, r, why);
}

static void dopt__tcp_shrink_free(dopt__tcp_shrinker *z, int n) {
    int r;
    for (r = 0; z->fd && r < n; r++)
        if (z->fd[r] >= 0) close(z->fd[r]);
    for (r = 0; r < z->npend; r++) close(z->pend[r]);
    dopt__agree_free(&z->a);
    DOPT_FREE(z->fd);
    DOPT_FREE(z->state);
    DOPT_FREE(z->ended);
    DOPT_FREE(z->rbuf);
    DOPT_FREE(z->got);
}

/* Starts the connection to rank r above this one. */
static void dopt__tcp_shrink_connect(dopt_comm *c, dopt__tcp *t, dopt__tcp_shrinker *z, int r) {
    struct sockaddr_storage ss;
    socklen_t len = dopt__tcp_sockaddr(&ss, t->peers[r].addr, t->peers[r].port);
    int fd = dopt__tcp_new_socket(t->peers[r].addr, t->sockbuf);
    if (fd < 0) {
        dopt__tcp_shrink_gone(c, z, r, "no socket to reach it");
        return;
    }
    z->fd[r] = fd;
    z->state[r] = 1;
    if (connect(fd, (struct sockaddr *)&ss, len) < 0 && errno != EINPROGRESS)
        dopt__tcp_shrink_gone(c, z, r, strerror(errno));
}

/* Rank r's connection is made: the hello goes (40 bytes fit any new connection's buffer). */
static void dopt__tcp_shrink_connected(dopt_comm *c, dopt__tcp *t, dopt__tcp_shrinker *z, int r) {
    unsigned char hello[DOPT__TCP_SHRINK_HELLO];
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(z->fd[r], SOL_SOCKET, SO_ERROR, &err, &len) < 0) err = errno;
    if (err) {
        dopt__tcp_shrink_gone(c, z, r, strerror(err));
        return;
    }
    dopt__tcp_shrink_hello(hello, t, c->epoch, t->rank, r);
    if (send(z->fd[r], hello, sizeof hello, MSG_NOSIGNAL) != (ssize_t)sizeof hello) {
        dopt__tcp_shrink_gone(c, z, r, "its connection failed at the hello");
        return;
    }
    z->state[r] = 2;
}

/* Reads what rank r below sent: a decision, read to its end and no further. 1: progress. */
static int dopt__tcp_shrink_read(dopt_comm *c, dopt__tcp *t, dopt__tcp_shrinker *z, int r) {
    unsigned char *buf = z->rbuf + (size_t)r * z->msg;
    ssize_t k = recv(z->fd[r], buf + z->got[r], z->msg - z->got[r], MSG_DONTWAIT);
    int w;
    if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        dopt__tcp_shrink_gone(c, z, r, k == 0 ? "its connection ended before its decision" : strerror(errno));
        return 1;
    }
    if (k < 0) return 0;
    z->got[r] += (size_t)k;
    if (z->got[r] >= 8 && (memcmp(buf, "DDEC", 4) != 0 || dopt__get_le32(buf + 4) != (uint32_t)t->size)) {
        dopt__tcp_shrink_gone(c, z, r, "it sent something that is not a decision");
        return 1;
    }
    if (z->got[r] < z->msg) return 1;
    for (w = 0; w < z->a.words; w++) ((uint64_t *)(void *)(buf + 8))[w] = dopt__get_le64(buf + 8 + 8 * (size_t)w);
    if (dopt__agree_has((const uint64_t *)(void *)(buf + 8), r)) { /* a rank does not count itself gone */
        dopt__tcp_shrink_gone(c, z, r, "its decision names itself");
        return 1;
    }
    dopt__agree_heard(&z->a, r, (const uint64_t *)(void *)(buf + 8));
    z->state[r] = 2;
    return 1;
}

/* A connection accepted on the listening socket: its hello, read whole or not at all yet. */
static int dopt__tcp_shrink_pending(dopt_comm *c, dopt__tcp *t, dopt__tcp_shrinker *z, int i) {
    ssize_t k = DOPT__TCP_SHRINK_HELLO; /* a parked hello is whole already */
    int from = -1;
    if (z->pgot[i] < DOPT__TCP_SHRINK_HELLO) {
        k = recv(z->pend[i], z->pbuf[i] + z->pgot[i], DOPT__TCP_SHRINK_HELLO - z->pgot[i], MSG_DONTWAIT);
        if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
        if (k > 0) z->pgot[i] += (size_t)k;
        if (k > 0 && z->pgot[i] < DOPT__TCP_SHRINK_HELLO) return 1;
    }
    if (k > 0 && memcmp(z->pbuf[i], "DSHR", 4) == 0 && dopt__get_le32(z->pbuf[i] + 8) > c->epoch &&
        t->nparked < DOPT__TCP_MAX_PENDING) {
        /* a rank already in the next shrink (it finished this one first): its hello waits for
           this rank's next shrink, on the next communicator */
        t->parked[t->nparked] = z->pend[i];
        memcpy(t->parked_hello[t->nparked++], z->pbuf[i], DOPT__TCP_SHRINK_HELLO);
    } else {
        if (k > 0) from = dopt__tcp_shrink_check_hello(c, t, z->pbuf[i]);
        if (from >= 0 && z->state[from] != 0) from = -1; /* gone already, or a second hello */
        if (from >= 0) {
            z->fd[from] = z->pend[i];
            z->state[from] = 1;
            z->got[from] = 0;
        } else {
            close(z->pend[i]);
        }
    }
    z->pend[i] = z->pend[--z->npend];
    memcpy(z->pbuf[i], z->pbuf[z->npend], DOPT__TCP_SHRINK_HELLO);
    z->pgot[i] = z->pgot[z->npend];
    return 1;
}

static void dopt__tcp_shrink_accept(dopt__tcp *t, dopt__tcp_shrinker *z) {
    for (;;) {
        int fd = accept(t->shrink_lfd, NULL, NULL);
        if (fd < 0) return;
        if (dopt__tcp_set_nonblocking(fd) < 0) {
            close(fd);
            continue;
        }
        if (z->npend == DOPT__TCP_MAX_PENDING) { /* a flood: the oldest goes */
            close(z->pend[0]);
            memmove(z->pend, z->pend + 1, sizeof(int) * (DOPT__TCP_MAX_PENDING - 1));
            memmove(z->pbuf, z->pbuf + 1, sizeof z->pbuf[0] * (DOPT__TCP_MAX_PENDING - 1));
            memmove(z->pgot, z->pgot + 1, sizeof(size_t) * (DOPT__TCP_MAX_PENDING - 1));
            z->npend--;
        }
        z->pend[z->npend] = fd;
        z->pgot[z->npend++] = 0;
    }
}

/* Drops what an old link still holds; 1 when it ended (its process died, or left the old
   communicator). */
static int dopt__tcp_shrink_old_ended(int fd) {
    unsigned char sink[4096];
    int i;
    for (i = 0; i < 64; i++) {
        ssize_t k = recv(fd, sink, sizeof sink, MSG_DONTWAIT);
        if (k > 0) continue;
        return k == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }
    return 0;
}

/* Runs the agreement until this rank decided; DOPT_OK, or NOMEM. */
static dopt_status dopt__tcp_shrink_agree(dopt_comm *c, dopt__tcp *t, dopt__tcp_shrinker *z) {
    int n = t->size, me = t->rank, r;
    double quiet_until = dopt__now_ms() + c->timeout_ms;
    struct pollfd *pf = (struct pollfd *)DOPT_MALLOC(sizeof(struct pollfd) * ((size_t)n + DOPT__TCP_MAX_PENDING + 1));
    int *who = (int *)DOPT_MALLOC(sizeof(int) * ((size_t)n + DOPT__TCP_MAX_PENDING + 1));
    if (pf == NULL || who == NULL) {
        DOPT_FREE(pf);
        DOPT_FREE(who);
        return DOPT_ERR_NOMEM;
    }
    for (r = me + 1; r < n; r++)
        if (z->state[r] == 0) dopt__tcp_shrink_connect(c, t, z, r);
    for (;;) {
        int np = 0, i, moved = 0, connecting = 0, wait_ms;
        double now = dopt__now_ms();
        for (r = me + 1; r < n; r++) connecting |= z->state[r] == 1;
        if (!connecting && dopt__agree_step(&z->a)) break;
        for (r = 0; r < me; r++) /* an old link ended with no connection after the grace: gone */
            if (z->state[r] == 0 && z->ended[r] > 0 && now - z->ended[r] >= DOPT__TCP_SHRINK_GRACE_MS) {
                if (t->shrink_lfd >= 0) dopt__tcp_shrink_accept(t, z); /* a starved loop: look first */
                for (i = z->npend - 1; i >= 0; i--) dopt__tcp_shrink_pending(c, t, z, i);
                if (z->state[r] == 0) dopt__tcp_shrink_gone(c, z, r, "its old link ended and it did not connect");
            }
        if (now >= quiet_until) { /* silence for the timeout: whoever is awaited is taken for gone */
            for (r = 0; r < n; r++)
                if ((r < me && z->state[r] >= 0 && z->state[r] < 2) || (r > me && z->state[r] == 1))
                    dopt__tcp_shrink_gone(c, z, r, "nothing from it for the timeout");
            continue;
        }
        if (t->shrink_lfd >= 0) {
            pf[np].fd = t->shrink_lfd;
            pf[np].events = POLLIN;
            who[np++] = -1;
        }
        for (i = 0; i < z->npend; i++) {
            pf[np].fd = z->pend[i];
            pf[np].events = POLLIN;
            who[np++] = -2 - i;
        }
        for (r = 0; r < n; r++) {
            if (r == me || z->state[r] < 0) continue;
            if (r < me && z->state[r] == 0 && z->ended[r] == 0 && t->peers[r].fd >= 0) {
                pf[np].fd = t->peers[r].fd; /* the old link, for its end */
                pf[np].events = POLLIN | DOPT__TCP_POLL_END;
            } else if (r < me && z->state[r] == 1) {
                pf[np].fd = z->fd[r];
                pf[np].events = POLLIN;
            } else if (r > me && z->state[r] == 1) {
                pf[np].fd = z->fd[r];
                pf[np].events = POLLOUT;
            } else if (r > me && z->state[r] == 2) {
                pf[np].fd = z->fd[r]; /* nothing comes from above: an end or a reset says it is gone */
                pf[np].events = DOPT__TCP_POLL_END;
            } else {
                continue;
            }
            who[np++] = r;
        }
        for (i = 0; i < np; i++) pf[i].revents = 0;
        wait_ms = dopt__ms_left(quiet_until);
        if (wait_ms > 50) wait_ms = 50; /* the grace and the silence are looked at this often */
        if (poll(pf, (nfds_t)np, wait_ms) <= 0) continue;
        for (i = 0; i < np; i++) {
            short re = pf[i].revents;
            if (!re) continue;
            if (who[i] == -1) {
                dopt__tcp_shrink_accept(t, z);
                moved = 1;
            } else if (who[i] <= -2) {
                continue; /* read below, once the indices are stable */
            } else if ((r = who[i]) < me && z->state[r] == 0) {
                if (dopt__tcp_shrink_old_ended(pf[i].fd)) z->ended[r] = dopt__now_ms();
            } else if (r < me) {
                moved |= dopt__tcp_shrink_read(c, t, z, r);
            } else if (z->state[r] == 1) {
                dopt__tcp_shrink_connected(c, t, z, r);
                moved = 1;
            } else if (re & (POLLHUP | POLLERR | DOPT__TCP_POLL_END)) {
                dopt__tcp_shrink_gone(c, z, r, "its connection ended");
                moved = 1;
            }
        }
        for (i = z->npend - 1; i >= 0; i--) moved |= dopt__tcp_shrink_pending(c, t, z, i);
        if (moved) quiet_until = dopt__now_ms() + c->timeout_ms;
    }
    DOPT_FREE(pf);
    DOPT_FREE(who);
    return DOPT_OK;
}

/* The ranks of set, as "1, 3" (at most cap bytes). */
static void dopt__tcp_ranks_str(const uint64_t *set, int n, char *out, size_t cap) {
    size_t used = 0;
    int r;
    out[0] = '\0';
    for (r = 0; r < n && used + 16 < cap; r++)
        if (dopt__agree_has(set, r)) used += (size_t)snprintf(out + used, cap - used, "%s%d", used ? ", " : "", r);
    if (used == 0) snprintf(out, cap, "none");
}

/* The survivors' communicator: the agreement's connections are its links. */
static dopt_status dopt__tcp_shrunk(dopt_comm *c, dopt__tcp *t, dopt__tcp_shrinker *z, dopt_comm **next) {
    int n = t->size, me = t->rank, m = 0, nr = 0, r, q;
    char token[DOPT_TCP_TOKEN_MAX + 1];
    dopt_tcp_config k;
    dopt_comm *c2 = NULL;
    dopt__tcp *t2;
    dopt_status s;
    for (r = 0; r < n; r++)
        if (!dopt__agree_has(z->a.value, r)) {
            if (r < me) nr++;
            m++;
        }
    dopt__tcp_like(c, t, nr, m, token, &k);
    s = dopt__tcp_new(&c2, &k);
    if (s != DOPT_OK) return dopt__shrink_fail(c, s, "cannot allocate the survivors' communicator");
    t2 = (dopt__tcp *)c2->impl;
    c2->epoch = c->epoch + 1;
    for (r = 0, q = 0; r < n; r++) {
        if (dopt__agree_has(z->a.value, r)) continue;
        memcpy(t2->peers[q].addr, t->peers[r].addr, 16);
        t2->peers[q].port = t->peers[r].port;
        if (r != me && z->state[r] == 2 && z->fd[r] >= 0) {
            t2->peers[q].fd = z->fd[r];
            z->fd[r] = -1;
        } else if (r != me) {
            /* a member this rank lost after the decision (or never heard): a link that has
               ended, so that the first collective names it and a second shrink leaves it out */
            t2->peers[q].fd = dopt__tcp_ended_link();
        }
        if (r != me && (t2->peers[q].fd < 0 || dopt__tcp_set_nonblocking(t2->peers[q].fd) < 0)) {
            dopt_comm_destroy(c2);
            return dopt__shrink_fail(c, DOPT_ERR_IO, "cannot make a link to rank %d: %s", r, strerror(errno));
        }
        q++;
    }
    t2->shrink_lfd = t->shrink_lfd; /* kept for the next shrink, with the hellos that came early */
    t->shrink_lfd = -1;
    memcpy(t2->parked, t->parked, sizeof t->parked);
    memcpy(t2->parked_hello, t->parked_hello, sizeof t->parked_hello);
    t2->nparked = t->nparked;
    t->nparked = 0;
    t2->joiners = t->joiners; /* held joiners wait for the survivors' round boundary */
    t2->njoiners = t->njoiners;
    t->joiners = NULL;
    t->njoiners = 0;
    if (me == 0) { /* rank 0 stays rank 0, and keeps refusing late joiners of the rendezvous */
        t2->lfd = t->lfd;
        t->lfd = -1;
    }
    t->shrunk = 1;
    if ((s = dopt__tcp_grown(c2, t2, t)) != DOPT_OK) /* ready, the recorder's files, hosts, progress */
        return dopt__shrink_fail(c, s, "cannot set up the survivors' communicator: %s", dopt_status_str(s));
    *next = c2;
    return DOPT_OK;
}

static dopt_status dopt__tcp_shrink(dopt_comm *c, dopt_comm **next) {
    dopt__tcp *t = (dopt__tcp *)c->impl;
    dopt__tcp_shrinker z;
    int n = t->size, me = t->rank, r, w, members = 0;
    double start = dopt__now_ms();
    char gone[160];
    dopt_status s;
    memset(&z, 0, sizeof z);
    if (dopt__agree_init(&z.a, n, me) != DOPT_OK) return dopt__shrink_fail(c, DOPT_ERR_NOMEM, "out of memory");
    z.msg = 8 + 8 * (size_t)z.a.words;
    z.fd = (int *)DOPT_MALLOC(sizeof(int) * (size_t)n);
    z.state = (int *)DOPT_MALLOC(sizeof(int) * (size_t)n);
    z.ended = (double *)DOPT_MALLOC(sizeof(double) * (size_t)n);
    z.rbuf = (unsigned char *)DOPT_MALLOC(z.msg * (size_t)n);
    z.got = (size_t *)DOPT_MALLOC(sizeof(size_t) * (size_t)n);
    if (!z.fd || !z.state || !z.ended || !z.rbuf || !z.got) {
        dopt__tcp_shrink_free(&z, 0);
        return dopt__shrink_fail(c, DOPT_ERR_NOMEM, "out of memory");
    }
    for (r = 0; r < n; r++) {
        z.fd[r] = -1;
        z.state[r] = 0;
        z.ended[r] = 0;
        z.got[r] = 0;
    }
    for (r = 0; r < t->nparked; r++) { /* hellos that came during the shrink that made c */
        z.pend[z.npend] = t->parked[r];
        memcpy(z.pbuf[z.npend], t->parked_hello[r], DOPT__TCP_SHRINK_HELLO);
        z.pgot[z.npend++] = DOPT__TCP_SHRINK_HELLO;
    }
    t->nparked = 0;
    for (r = t->npend - 1; r >= 0; r--) { /* taken by the lobby in a collective's wait, not read whole yet */
        dopt__tcp_pending *q = &t->pend[r];
        if (z.npend == DOPT__TCP_MAX_PENDING || (q->got >= 4 && memcmp(q->rec, "DSHR", 4) != 0)) continue;
        z.pend[z.npend] = q->fd;
        memcpy(z.pbuf[z.npend], q->rec, q->got);
        z.pgot[z.npend++] = q->got;
        *q = t->pend[--t->npend];
    }
    if (c->lost_rank >= 0 && c->lost_rank < n && c->lost_rank != me)
        dopt__tcp_shrink_gone(c, &z, c->lost_rank, "the failure named it");
    s = dopt__tcp_shrink_agree(c, t, &z);
    if (s != DOPT_OK) {
        dopt__tcp_shrink_free(&z, n);
        return dopt__shrink_fail(c, s, "out of memory");
    }
    /* tell every rank above (the left out too: they learn it), then hand the links over */
    {
        unsigned char *msg = z.rbuf + (size_t)me * z.msg;
        memcpy(msg, "DDEC", 4);
        dopt__put_le32(msg + 4, (uint32_t)n);
        for (w = 0; w < z.a.words; w++) dopt__put_le64(msg + 8 + 8 * (size_t)w, z.a.value[w]);
        for (r = me + 1; r < n; r++) {
            size_t off = 0;
            double deadline = dopt__now_ms() + c->timeout_ms;
            while (z.state[r] == 2 && off < z.msg) {
                struct pollfd pf;
                ssize_t k = send(z.fd[r], msg + off, z.msg - off, MSG_NOSIGNAL | MSG_DONTWAIT);
                if (k > 0) {
                    off += (size_t)k;
                    continue;
                }
                if ((k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) || dopt__now_ms() >= deadline) {
                    dopt__tcp_shrink_gone(c, &z, r, "its connection failed at the decision");
                    break;
                }
                pf.fd = z.fd[r];
                pf.events = POLLOUT;
                pf.revents = 0;
                poll(&pf, 1, 50);
            }
        }
    }
    for (r = 0; r < n; r++) members += !dopt__agree_has(z.a.value, r);
    dopt__tcp_ranks_str(z.a.value, n, gone, sizeof gone);
    if (dopt__agree_has(z.a.value, me))
        s = dopt__shrink_fail(c, DOPT_ERR_PEER_LOST,
                                  "the survivors left this rank out (rank %d decided that ranks %s are gone: this rank "
                                  "was taken for lost, too slow to answer); end this process, or restart it",
                                  z.a.from, gone);
    else if (members < c->min_ranks)
        s = dopt__shrink_fail(c, DOPT_ERR_PEER_LOST,
                                  "%d of %d ranks survive (ranks %s are gone), fewer than min_ranks %d: the job cannot go on",
                                  members, n, gone, c->min_ranks);
    else
        s = dopt__tcp_shrunk(c, t, &z, next);
    if (s == DOPT_OK)
        dopt_comm_log(*next, DOPT_LOG_INFO, "tcp rank %d of %d (rank %d of %d before): ranks %s left out, epoch %u, "
                      "agreed in %.1f ms", (*next)->rank, (*next)->size, me, n, gone, (unsigned)(*next)->epoch,
                      dopt__now_ms() - start);
    dopt__tcp_shrink_free(&z, n);
    return s;
}

/* ===================================================================== RE-ADMIT: THE JOINER'S HANDSHAKE

   The first step of taking a restarted worker back (WIRE FORMAT: joiner's handshake): a process
   of the job proves to a member that it holds the job's token, and the member proves the same to
   it, neither sending the token. Each side draws a 16-byte nonce; a proof is a 128-bit keyed hash
   (SipHash-2-4 twice, under a 128-bit key derived from the token) of a label, both nonces and what
   the sender states, so that a recorded conversation proves nothing to either side later. Both
   sides are state machines over bytes in memory: socket code feeds them what it read and writes
   what they return, and fuzz/fuzz_tcp_join.c drives them with no socket at all. */

#define DOPT__TCP_JOIN_BYTES 64  /* every record of the joiner's handshake */
#define DOPT__TCP_JOIN_VERSION 1
#define DOPT__TCP_NONCE_BYTES 16
#define DOPT__TCP_PROOF_BYTES 16

enum { /* record types */
    DOPT__JOIN_ASK = 1,       /* joiner → member: its nonce and listening address */
    DOPT__JOIN_CHALLENGE = 2, /* member → joiner: its nonce, its proof, epoch, size, rank */
    DOPT__JOIN_ANSWER = 3,    /* joiner → member: its proof */
    DOPT__JOIN_QUEUED = 4,    /* member → joiner: held for the next round boundary */
    DOPT__JOIN_REFUSE = 5,    /* member → joiner: a reason, then the member closes */
    DOPT__JOIN_ADMIT = 6      /* member → held joiner: its rank in the grown communicator; the table follows */
};

enum { /* REFUSE reasons */
    DOPT__JOIN_WRONG_TOKEN = 1, /* the joiner's proof is not the job token's */
    DOPT__JOIN_WRONG_VERSION = 2,
    DOPT__JOIN_MALFORMED = 3,   /* a record that is not what the member waits for */
    DOPT__JOIN_BUSY = 4,        /* the member holds as many joiners as it takes */
    DOPT__JOIN_CLOSED = 5       /* the job does not take joiners (or no longer) */
};

enum { /* where a conversation stands, on either side */
    DOPT__JOIN_REFUSED = -1,
    DOPT__JOIN_WAIT_ASK = 0,    /* member: nothing read yet */
    DOPT__JOIN_WAIT_REPLY = 1,  /* member: CHALLENGE sent, awaits ANSWER; joiner: ASK sent, awaits CHALLENGE */
    DOPT__JOIN_WAIT_VERDICT = 2, /* joiner: ANSWER sent, awaits QUEUED or REFUSE */
    DOPT__JOIN_HELD = 3         /* both: the joiner is proven and held for the next round boundary */
};

static const char *const dopt__join_reasons[] = {
    "", "the job token differs", "another version of the joiner's handshake", "a malformed record",
    "the member holds as many joiners as it takes", "the job takes no joiners"};

/* SipHash-2-4 (Aumasson and Bernstein 2012): a 64-bit keyed hash of n bytes under key k. */
#define DOPT__ROTL64(x, b) (((x) << (b)) | ((x) >> (64 - (b))))
#define DOPT__SIPROUND(v0, v1, v2, v3)                                                                                  \
    do {                                                                                                               \
        v0 += v1, v1 = DOPT__ROTL64(v1, 13), v1 ^= v0, v0 = DOPT__ROTL64(v0, 32);                                       \
        v2 += v3, v3 = DOPT__ROTL64(v3, 16), v3 ^= v2;                                                                  \
        v0 += v3, v3 = DOPT__ROTL64(v3, 21), v3 ^= v0;                                                                  \
        v2 += v1, v1 = DOPT__ROTL64(v1, 17), v1 ^= v2, v2 = DOPT__ROTL64(v2, 32);                                       \
    } while (0)

static uint64_t dopt__siphash24(const uint64_t k[2], const unsigned char *in, size_t n) {
    uint64_t v0 = k[0] ^ 0x736f6d6570736575ull, v1 = k[1] ^ 0x646f72616e646f6dull;
    uint64_t v2 = k[0] ^ 0x6c7967656e657261ull, v3 = k[1] ^ 0x7465646279746573ull, b = (uint64_t)n << 56;
    size_t i, whole = n - n % 8;
    for (i = 0; i < whole; i += 8) {
        uint64_t m = dopt__get_le64(in + i);
        v3 ^= m;
        DOPT__SIPROUND(v0, v1, v2, v3);
        DOPT__SIPROUND(v0, v1, v2, v3);
        v0 ^= m;
    }
    for (i = 0; i < n % 8; i++) b |= (uint64_t)in[whole + i] << (8 * i);
    v3 ^= b;
    DOPT__SIPROUND(v0, v1, v2, v3);
    DOPT__SIPROUND(v0, v1, v2, v3);
    v0 ^= b;
    v2 ^= 0xff;
    for (i = 0; i < 4; i++) DOPT__SIPROUND(v0, v1, v2, v3);
    return v0 ^ v1 ^ v2 ^ v3;
}

/* The handshake's key: SipHash of the zero-padded token under two fixed keys. */
static void dopt__join_key(const unsigned char token[DOPT_TCP_TOKEN_MAX], uint64_t key[2]) {
    static const uint64_t k0[2] = {0x6e696f6a74706f64ull, 0x3079656b2d6e6f69ull}; /* "doptjoin", "ion-key0" */
    static const uint64_t k1[2] = {0x6e696f6a74706f64ull, 0x3179656b2d6e6f69ull};
    key[0] = dopt__siphash24(k0, token, DOPT_TCP_TOKEN_MAX);
    key[1] = dopt__siphash24(k1, token, DOPT_TCP_TOKEN_MAX);
}

/* A 128-bit proof: SipHash of (label, half, nonce_j, nonce_m, stated) for half 0 and 1. */
static void dopt__join_proof(const uint64_t key[2], char label, const unsigned char *nonce_j,
                             const unsigned char *nonce_m, const unsigned char *stated, size_t stated_bytes,
                             unsigned char out[DOPT__TCP_PROOF_BYTES]) {
    unsigned char m[2 + 2 * DOPT__TCP_NONCE_BYTES + 20];
    int half;
    m[0] = (unsigned char)label;
    memcpy(m + 2, nonce_j, DOPT__TCP_NONCE_BYTES);
    memcpy(m + 2 + DOPT__TCP_NONCE_BYTES, nonce_m, DOPT__TCP_NONCE_BYTES);
    memcpy(m + 2 + 2 * DOPT__TCP_NONCE_BYTES, stated, stated_bytes); /* at most 20 */
    for (half = 0; half < 2; half++) {
        m[1] = (unsigned char)half;
        dopt__put_le64(out + 8 * half, dopt__siphash24(key, m, 2 + 2 * DOPT__TCP_NONCE_BYTES + stated_bytes));
    }
}

/* 16 bytes from the kernel's random source for a nonce; 0 on success, -1 when there is none. */
static int dopt__join_nonce(unsigned char out[DOPT__TCP_NONCE_BYTES]) {
    size_t got = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    while (got < DOPT__TCP_NONCE_BYTES) {
        ssize_t n = read(fd, out + got, DOPT__TCP_NONCE_BYTES - got);
        if (n <= 0 && !(n < 0 && errno == EINTR)) break;
        if (n > 0) got += (size_t)n;
    }
    close(fd);
    return got == DOPT__TCP_NONCE_BYTES ? 0 : -1;
}

/* One record, decoded. */
typedef struct dopt__join_rec {
    int type;
    unsigned char nonce[DOPT__TCP_NONCE_BYTES]; /* ASK, CHALLENGE */
    unsigned char proof[DOPT__TCP_PROOF_BYTES]; /* CHALLENGE, ANSWER */
    unsigned char addr[16];                     /* ASK: the joiner's listening address */
    uint32_t port;                              /* ASK: its listening port */
    uint32_t epoch, size, rank;                 /* CHALLENGE: the member's communicator and rank */
    uint32_t reason;                            /* REFUSE */
    uint32_t members;                           /* ADMIT: the members before the grow (epoch, size, rank too) */
} dopt__join_rec;

static void dopt__join_encode(unsigned char *out, const dopt__join_rec *r) {
    memset(out, 0, DOPT__TCP_JOIN_BYTES);
    memcpy(out, "DJON", 4);
    out[4] = DOPT__TCP_JOIN_VERSION;
    out[5] = (unsigned char)r->type;
    switch (r->type) {
    case DOPT__JOIN_ASK:
        memcpy(out + 8, r->nonce, DOPT__TCP_NONCE_BYTES);
        dopt__put_le16(out + 24, r->port);
        memcpy(out + 28, r->addr, 16);
        break;
    case DOPT__JOIN_CHALLENGE:
        memcpy(out + 8, r->nonce, DOPT__TCP_NONCE_BYTES);
        memcpy(out + 24, r->proof, DOPT__TCP_PROOF_BYTES);
        dopt__put_le32(out + 40, r->epoch);
        dopt__put_le32(out + 44, r->size);
        dopt__put_le32(out + 48, r->rank);
        break;
    case DOPT__JOIN_ANSWER: memcpy(out + 8, r->proof, DOPT__TCP_PROOF_BYTES); break;
    case DOPT__JOIN_REFUSE: dopt__put_le16(out + 8, r->reason); break;
    case DOPT__JOIN_ADMIT:
        dopt__put_le32(out + 8, r->epoch);
        dopt__put_le32(out + 12, r->size);
        dopt__put_le32(out + 16, r->rank);
        dopt__put_le32(out + 20, r->members);
        break;
    default: break; /* QUEUED: the header alone */
    }
}

/* NULL when in[0..64) is a well-formed record of this version, else why not (r->type is set
   from byte 5 even then; a record of another version comes back as "another version"). */
static const char *dopt__join_decode(const unsigned char *in, dopt__join_rec *r) {
    static const unsigned char used_to[7] = {8, 44, 52, 24, 8, 10, 24}; /* bytes in use by type (index 0: none) */
    memset(r, 0, sizeof *r);
    if (memcmp(in, "DJON", 4) != 0) return "not a joiner's record";
    if (in[4] != DOPT__TCP_JOIN_VERSION) return "another version of the joiner's handshake";
    r->type = in[5];
    if (r->type < DOPT__JOIN_ASK || r->type > DOPT__JOIN_ADMIT) return "unknown record type";
    if (!dopt__tcp_all_zero(in + 6, 2) || !dopt__tcp_all_zero(in + used_to[r->type], DOPT__TCP_JOIN_BYTES - used_to[r->type]))
        return "reserved bytes are not zero";
    switch (r->type) {
    case DOPT__JOIN_ASK:
        memcpy(r->nonce, in + 8, DOPT__TCP_NONCE_BYTES);
        r->port = dopt__get_le16(in + 24);
        if (!dopt__tcp_all_zero(in + 26, 2)) return "reserved bytes are not zero";
        memcpy(r->addr, in + 28, 16);
        if (r->port == 0) return "listening port 0";
        break;
    case DOPT__JOIN_CHALLENGE:
        memcpy(r->nonce, in + 8, DOPT__TCP_NONCE_BYTES);
        memcpy(r->proof, in + 24, DOPT__TCP_PROOF_BYTES);
        r->epoch = dopt__get_le32(in + 40);
        r->size = dopt__get_le32(in + 44);
        r->rank = dopt__get_le32(in + 48);
        if (r->size < 1 || r->size > (uint32_t)INT_MAX || r->rank >= r->size) return "rank or size out of range";
        break;
    case DOPT__JOIN_ANSWER: memcpy(r->proof, in + 8, DOPT__TCP_PROOF_BYTES); break;
    case DOPT__JOIN_REFUSE:
        r->reason = dopt__get_le16(in + 8);
        if (r->reason < DOPT__JOIN_WRONG_TOKEN || r->reason > DOPT__JOIN_CLOSED) return "unknown refusal reason";
        break;
    case DOPT__JOIN_ADMIT:
        r->epoch = dopt__get_le32(in + 8);
        r->size = dopt__get_le32(in + 12);
        r->rank = dopt__get_le32(in + 16);
        r->members = dopt__get_le32(in + 20);
        if (r->members < 1 || r->size <= r->members || r->size > DOPT__TCP_MAX_GROWN || r->rank < r->members ||
            r->rank >= r->size)
            return "ranks that do not fit (members, size, rank)";
        if (r->epoch == 0) return "epoch 0 (a grown communicator's epoch is its members' + 1)";
        break;
    default: break;
    }
    return NULL;
}

/* What a member states in its CHALLENGE and proves with it: epoch, size, rank (12 bytes). */
static void dopt__join_member_stated(const dopt__join_rec *r, unsigned char out[12]) {
    dopt__put_le32(out, r->epoch);
    dopt__put_le32(out + 4, r->size);
    dopt__put_le32(out + 8, r->rank);
}

/* What a joiner states in its ASK and proves with its ANSWER: port, address (18 bytes). */
static void dopt__join_joiner_stated(const unsigned char addr[16], uint32_t port, unsigned char out[18]) {
    dopt__put_le16(out, port);
    memcpy(out + 2, addr, 16);
}

/* One side of a conversation: the member's (serving one connection) or the joiner's. */
typedef struct dopt__join_side {
    int stage;                                    /* DOPT__JOIN_WAIT_ASK ... HELD, or REFUSED */
    uint64_t key[2];
    unsigned char nonce_j[DOPT__TCP_NONCE_BYTES], nonce_m[DOPT__TCP_NONCE_BYTES];
    unsigned char addr[16];                       /* the joiner's listening address and port */
    uint32_t port;
    uint32_t epoch, size, rank;                   /* the member's communicator and rank */
    uint32_t reason;                              /* REFUSED: a DOPT__JOIN_* reason, 0 when the joiner judged */
    const char *why;                              /* REFUSED: what went wrong, for the log */
    unsigned char in[DOPT__TCP_JOIN_BYTES];       /* a record being read */
    size_t got;
} dopt__join_side;

/* The member's side of a new connection whose first bytes said "DJON": nonce_m fresh for it. */
static void dopt__join_serve_init(dopt__join_side *s, const unsigned char token[DOPT_TCP_TOKEN_MAX],
                                  const unsigned char nonce_m[DOPT__TCP_NONCE_BYTES], uint32_t epoch, uint32_t size,
                                  uint32_t rank) {
    memset(s, 0, sizeof *s);
    s->stage = DOPT__JOIN_WAIT_ASK;
    dopt__join_key(token, s->key);
    memcpy(s->nonce_m, nonce_m, DOPT__TCP_NONCE_BYTES);
    s->epoch = epoch, s->size = size, s->rank = rank;
}

/* The joiner's side: out gets the ASK to send. */
DOPT__MAYBE_UNUSED static void dopt__join_ask_init(dopt__join_side *s, const unsigned char token[DOPT_TCP_TOKEN_MAX],
                                const unsigned char nonce_j[DOPT__TCP_NONCE_BYTES], const unsigned char addr[16],
                                uint32_t port, unsigned char out[DOPT__TCP_JOIN_BYTES]) {
    dopt__join_rec r;
    memset(s, 0, sizeof *s);
    s->stage = DOPT__JOIN_WAIT_REPLY;
    dopt__join_key(token, s->key);
    memcpy(s->nonce_j, nonce_j, DOPT__TCP_NONCE_BYTES);
    memcpy(s->addr, addr, 16);
    s->port = port;
    memset(&r, 0, sizeof r);
    r.type = DOPT__JOIN_ASK;
    memcpy(r.nonce, nonce_j, DOPT__TCP_NONCE_BYTES);
    memcpy(r.addr, addr, 16);
    r.port = port;
    dopt__join_encode(out, &r);
}

/* Ends a conversation as refused; a member with a reason also answers with REFUSE. */
static int dopt__join_refuse(dopt__join_side *s, int member, uint32_t reason, const char *why,
                             unsigned char out[DOPT__TCP_JOIN_BYTES]) {
    dopt__join_rec r;
    s->stage = DOPT__JOIN_REFUSED;
    s->reason = reason;
    s->why = why;
    if (!member || reason == 0) return 0;
    memset(&r, 0, sizeof r);
    r.type = DOPT__JOIN_REFUSE;
    r.reason = reason;
    dopt__join_encode(out, &r);
    return 1;
}

/* One whole record read by the member. Returns 1 when out holds a record to send. */
static int dopt__join_serve_record(dopt__join_side *s, unsigned char out[DOPT__TCP_JOIN_BYTES]) {
    dopt__join_rec r, reply;
    unsigned char stated[18], proof[DOPT__TCP_PROOF_BYTES];
    const char *bad = dopt__join_decode(s->in, &r);
    if (bad && memcmp(s->in, "DJON", 4) == 0 && s->in[4] != DOPT__TCP_JOIN_VERSION)
        return dopt__join_refuse(s, 1, DOPT__JOIN_WRONG_VERSION, bad, out);
    if (bad) return dopt__join_refuse(s, 1, DOPT__JOIN_MALFORMED, bad, out);
    if (s->stage == DOPT__JOIN_WAIT_ASK && r.type == DOPT__JOIN_ASK) {
        memcpy(s->nonce_j, r.nonce, DOPT__TCP_NONCE_BYTES);
        memcpy(s->addr, r.addr, 16);
        s->port = r.port;
        memset(&reply, 0, sizeof reply);
        reply.type = DOPT__JOIN_CHALLENGE;
        memcpy(reply.nonce, s->nonce_m, DOPT__TCP_NONCE_BYTES);
        reply.epoch = s->epoch, reply.size = s->size, reply.rank = s->rank;
        dopt__join_member_stated(&reply, stated);
        dopt__join_proof(s->key, 'M', s->nonce_j, s->nonce_m, stated, 12, reply.proof);
        dopt__join_encode(out, &reply);
        s->stage = DOPT__JOIN_WAIT_REPLY;
        return 1;
    }
    if (s->stage == DOPT__JOIN_WAIT_REPLY && r.type == DOPT__JOIN_ANSWER) {
        dopt__join_joiner_stated(s->addr, s->port, stated);
        dopt__join_proof(s->key, 'J', s->nonce_j, s->nonce_m, stated, 18, proof);
        if (!dopt__tcp_same_bytes(proof, r.proof, DOPT__TCP_PROOF_BYTES))
            return dopt__join_refuse(s, 1, DOPT__JOIN_WRONG_TOKEN, "its proof is not the job token's", out);
        memset(&reply, 0, sizeof reply);
        reply.type = DOPT__JOIN_QUEUED;
        dopt__join_encode(out, &reply);
        s->stage = DOPT__JOIN_HELD;
        return 1;
    }
    return dopt__join_refuse(s, 1, DOPT__JOIN_MALFORMED, "a record out of turn", out);
}

/* One whole record read by the joiner. Returns 1 when out holds a record to send. */
static int dopt__join_ask_record(dopt__join_side *s, unsigned char out[DOPT__TCP_JOIN_BYTES]) {
    dopt__join_rec r, reply;
    unsigned char stated[18], proof[DOPT__TCP_PROOF_BYTES];
    const char *bad = dopt__join_decode(s->in, &r);
    if (bad) return dopt__join_refuse(s, 0, 0, bad, out);
    if (r.type == DOPT__JOIN_REFUSE) {
        s->stage = DOPT__JOIN_REFUSED;
        s->reason = r.reason;
        s->why = dopt__join_reasons[r.reason];
        return 0;
    }
    if (s->stage == DOPT__JOIN_WAIT_REPLY && r.type == DOPT__JOIN_CHALLENGE) {
        dopt__join_member_stated(&r, stated);
        dopt__join_proof(s->key, 'M', s->nonce_j, r.nonce, stated, 12, proof);
        if (!dopt__tcp_same_bytes(proof, r.proof, DOPT__TCP_PROOF_BYTES))
            return dopt__join_refuse(s, 0, 0, "the member's proof is not the job token's", out);
        memcpy(s->nonce_m, r.nonce, DOPT__TCP_NONCE_BYTES);
        s->epoch = r.epoch, s->size = r.size, s->rank = r.rank;
        memset(&reply, 0, sizeof reply);
        reply.type = DOPT__JOIN_ANSWER;
        dopt__join_joiner_stated(s->addr, s->port, stated);
        dopt__join_proof(s->key, 'J', s->nonce_j, s->nonce_m, stated, 18, reply.proof);
        dopt__join_encode(out, &reply);
        s->stage = DOPT__JOIN_WAIT_VERDICT;
        return 1;
    }
    if (s->stage == DOPT__JOIN_WAIT_VERDICT && r.type == DOPT__JOIN_QUEUED) {
        s->stage = DOPT__JOIN_HELD;
        return 0;
    }
    return dopt__join_refuse(s, 0, 0, "a record out of turn", out);
}

/* Feeds n bytes the other side sent. Returns how many it took (it stops after each whole record,
   and takes nothing once the conversation is over: held or refused); *reply is set to 1 when
   out holds a record to send before feeding more. A held conversation takes no more bytes: what
   follows belongs to the admission. */
static size_t dopt__join_feed(dopt__join_side *s, int member, const unsigned char *in, size_t n,
                              unsigned char out[DOPT__TCP_JOIN_BYTES], int *reply) {
    size_t take;
    *reply = 0;
    if (s->stage == DOPT__JOIN_REFUSED || s->stage == DOPT__JOIN_HELD) return 0;
    take = DOPT__TCP_JOIN_BYTES - s->got;
    if (take > n) take = n;
    memcpy(s->in + s->got, in, take);
    s->got += take;
    if (s->got < DOPT__TCP_JOIN_BYTES) return take;
    s->got = 0;
    *reply = member ? dopt__join_serve_record(s, out) : dopt__join_ask_record(s, out);
    return take;
}

/* ===================================================================== RE-ADMIT: MEMBERS HOLD JOINERS

   Once the job formed, every member that can take joiners listens: rank 0 on its rendezvous
   socket, the others of a DOPT_SHRINK job on the socket they keep for the survivors' agreement.
   The lobby that serves them runs inside the collectives' waits (dopt__tcp_link_wait), one
   nonblocking read or write at a time, so a joiner never holds the job up. A connection is sorted
   by its first 4 bytes (dopt__tcp_pending_read): a rendezvous HELLO is refused as before; a
   survivor's hello that came before this rank started the same shrink is checked and parked for
   it; a joiner's ASK starts a conversation here. At most DOPT__TCP_MAX_JOINERS conversations or
   held joiners at once (another is refused as BUSY); one that has not finished its handshake
   within DOPT__TCP_JOIN_IDLE_MS is dropped; a held one is watched for its end. Strangers that
   never speak fill the lobby's DOPT__TCP_MAX_PENDING places and are dropped oldest first. */

typedef struct dopt__tcp_joiner {
    int fd;
    dopt__join_side side;
    unsigned char from[16]; /* where the connection came from */
    uint32_t from_port;
    double since;           /* accepted at (dopt__now_ms) */
} dopt__tcp_joiner;

static void dopt__tcp_joiner_drop(dopt_comm *c, dopt__tcp *t, int j, dopt_log_level level, const char *why) {
    char from[DOPT__TCP_ADDR_CHARS];
    dopt__tcp_addr_str(t->joiners[j].from, t->joiners[j].from_port, from, sizeof from);
    dopt_comm_log(c, level, "rank %d: %s joiner from %s: %s", t->rank,
                  t->joiners[j].side.stage == DOPT__JOIN_HELD ? "dropped the held" : "refused a", from, why);
    close(t->joiners[j].fd);
    t->joiners[j] = t->joiners[--t->njoiners];
}

static void dopt__tcp_joiners_free(dopt__tcp *t) {
    int j;
    for (j = 0; j < t->njoiners; j++) close(t->joiners[j].fd);
    t->njoiners = 0;
    DOPT_FREE(t->joiners);
    t->joiners = NULL;
}

/* Appends the joiners' connections to t->pfd from np (after dropping those whose handshake took
   too long); returns the new count. */
static int dopt__tcp_joiners_add(dopt_comm *c, dopt__tcp *t, int np) {
    double now = dopt__now_ms();
    int j;
    for (j = t->njoiners - 1; j >= 0; j--)
        if (t->joiners[j].side.stage != DOPT__JOIN_HELD && now - t->joiners[j].since > DOPT__TCP_JOIN_IDLE_MS)
            dopt__tcp_joiner_drop(c, t, j, DOPT_LOG_WARN, "its handshake did not end in time");
    for (j = 0; j < t->njoiners; j++) {
        t->pfd[np].fd = t->joiners[j].fd;
        t->pfd[np].events = POLLIN | DOPT__TCP_POLL_END;
        t->pfd[np].revents = 0;
        t->pfd_peer[np++] = -2 - DOPT__TCP_MAX_PENDING - j;
    }
    return np;
}

/* Joiners held for the next round boundary. */
DOPT__MAYBE_UNUSED static int dopt__tcp_joiners_held(const dopt__tcp *t) {
    int j, n = 0;
    for (j = 0; j < t->njoiners; j++) n += t->joiners[j].side.stage == DOPT__JOIN_HELD;
    return n;
}

static int dopt__tcp_comm_joiners_held(const dopt_comm *c) {
    return dopt__tcp_joiners_held((const dopt__tcp *)c->impl);
}

/* Reads what joiner j sent (never past the record it is in) and answers. */
static void dopt__tcp_joiner_serve(dopt_comm *c, dopt__tcp *t, int j) {
    dopt__tcp_joiner *jn = &t->joiners[j];
    unsigned char in[DOPT__TCP_JOIN_BYTES], out[DOPT__TCP_JOIN_BYTES];
    char listens[DOPT__TCP_ADDR_CHARS], from[DOPT__TCP_ADDR_CHARS];
    int held = jn->side.stage == DOPT__JOIN_HELD, reply;
    ssize_t n = recv(jn->fd, in, held ? 1 : DOPT__TCP_JOIN_BYTES - jn->side.got, MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) {
        dopt__tcp_joiner_drop(c, t, j, held ? DOPT_LOG_INFO : DOPT_LOG_WARN,
                              n == 0 ? "its connection ended" : strerror(errno));
        return;
    }
    if (held) {
        dopt__tcp_joiner_drop(c, t, j, DOPT_LOG_WARN, "it spoke while held");
        return;
    }
    (void)dopt__join_feed(&jn->side, 1, in, (size_t)n, out, &reply);
    /* one record answers one record: a connection with no room for 64 bytes is not worth waiting for */
    if (reply && send(jn->fd, out, sizeof out, MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof out) {
        jn->side.stage = DOPT__JOIN_REFUSED;
        dopt__tcp_joiner_drop(c, t, j, DOPT_LOG_WARN, "it did not take the answer");
        return;
    }
    if (jn->side.stage == DOPT__JOIN_REFUSED) {
        dopt__tcp_joiner_drop(c, t, j, DOPT_LOG_WARN, jn->side.why);
        return;
    }
    if (jn->side.stage == DOPT__JOIN_HELD) {
        dopt__tcp_addr_str(jn->from, jn->from_port, from, sizeof from);
        dopt__tcp_addr_str(dopt__tcp_is_any(jn->side.addr) ? jn->from : jn->side.addr, jn->side.port, listens,
                           sizeof listens);
        dopt_comm_log(c, DOPT_LOG_INFO, "rank %d: holds a joiner from %s (it listens on %s) for the next round boundary",
                      t->rank, from, listens);
    }
}

/* Keeps q's connection and its 40-byte hello in fds/hellos for the agreement it belongs to
   when ok and there is room; else refuses it. -1: q is no longer the lobby's. */
static int dopt__tcp_park(dopt_comm *c, dopt__tcp *t, dopt__tcp_pending *q, int ok, int *fds,
                          unsigned char (*hellos)[DOPT__TCP_SHRINK_HELLO], int *n, const char *whose) {
    char why[64];
    if (ok && *n < DOPT__TCP_MAX_PENDING) {
        fds[*n] = q->fd;
        memcpy(hellos[(*n)++], q->rec, DOPT__TCP_SHRINK_HELLO);
        q->fd = -1;
    } else {
        snprintf(why, sizeof why, "%s hello this rank does not wait for", whose);
        dopt__tcp_refuse(c, t, q, NULL, 0, why);
    }
    return -1;
}

/* A connection whose first 4 bytes were not a rendezvous HELLO: a joiner's ASK (its conversation
   starts, or it is refused with a reason) or a survivor's whole hello (parked for the shrink
   this rank has not started). Returns -1: q is no longer the lobby's (its fd moved or closed). */
static int dopt__tcp_lobby_other(dopt_comm *c, dopt__tcp *t, dopt__tcp_pending *q) {
    unsigned char nonce[DOPT__TCP_NONCE_BYTES], out[DOPT__TCP_JOIN_BYTES];
    dopt__join_side refusal;
    dopt__tcp_joiner *jn;
    uint32_t reason = 0;
    const char *why = NULL;
    int reply;
    if (memcmp(q->rec, "DSHR", 4) == 0) {
        int ok = t->ready && t->shrink_lfd >= 0 && dopt__tcp_shrink_hello_later(c, t, q->rec);
        return dopt__tcp_park(c, t, q, ok, t->parked, t->parked_hello, &t->nparked, "a survivor's");
    }
    if (memcmp(q->rec, "DGRW", 4) == 0) { /* a rank below, already done gathering: for this rank's grow */
        int ok = t->ready && dopt__tcp_grow_hello_ok(t, q->rec, c->epoch + 1, NULL);
        return dopt__tcp_park(c, t, q, ok, t->gparked, t->gparked_hello, &t->ngparked, "a grow's");
    }
    if (!t->ready)
        reason = DOPT__JOIN_CLOSED, why = "the job has not formed yet";
    else if (t->on_peer_lost != DOPT_SHRINK)
        reason = DOPT__JOIN_CLOSED, why = "the job takes no joiners (on_peer_lost is not DOPT_SHRINK)";
    else if (t->njoiners == DOPT__TCP_MAX_JOINERS)
        reason = DOPT__JOIN_BUSY, why = "as many joiners as a member takes are here already";
    else if (t->joiners == NULL &&
             (t->joiners = (dopt__tcp_joiner *)DOPT_MALLOC(sizeof(dopt__tcp_joiner) * DOPT__TCP_MAX_JOINERS)) == NULL)
        reason = DOPT__JOIN_BUSY, why = "out of memory";
    else if (dopt__join_nonce(nonce) < 0)
        reason = DOPT__JOIN_CLOSED, why = "no random bytes for a nonce (/dev/urandom)";
    if (reason) {
        if (dopt__join_refuse(&refusal, 1, reason, why, out))
            (void)!send(q->fd, out, sizeof out, MSG_NOSIGNAL | MSG_DONTWAIT);
        dopt__tcp_refuse(c, t, q, NULL, 0, why);
        return -1;
    }
    jn = &t->joiners[t->njoiners++];
    jn->fd = q->fd;
    q->fd = -1;
    memcpy(jn->from, q->addr, 16);
    jn->from_port = q->port;
    jn->since = dopt__now_ms();
    dopt__join_serve_init(&jn->side, t->token, nonce, (uint32_t)c->epoch, (uint32_t)t->size, (uint32_t)t->rank);
    (void)dopt__join_feed(&jn->side, 1, q->rec, 4, out, &reply); /* "DJON": the rest is read by its conversation */
    return -1;
}

/* ===================================================================== RE-ADMIT: THE JOINER ASKS

   A joiner asks the members it was given in turn (rank 0's address first: any member may be
   gone): a member that cannot be reached, or refuses as BUSY or CLOSED, sends it to the next;
   one that refuses its token (or proves another token) ends the asking with DOPT_ERR_AUTH, as
   no member of this job would take it. A connection gets DOPT__TCP_JOIN_CONNECT_MS to open and
   the communicator's timeout to answer (a member answers inside its collectives, so one that
   computes between them answers late). After each pass over the list the joiner waits, 100 ms
   doubling to 1 s, and asks again until the deadline. */

#define DOPT__TCP_JOIN_CONNECT_MS 3000

/* Waits until fd is ready for events or the clock passes until: 1 ready, 0 not. */
static int dopt__tcp_join_poll(int fd, short events, double until) {
    for (;;) {
        struct pollfd pf;
        double left = until - dopt__now_ms();
        int n;
        if (left <= 0) return 0;
        pf.fd = fd;
        pf.events = events;
        pf.revents = 0;
        n = poll(&pf, 1, (int)left + 1);
        if (n > 0) return 1;
        if (n < 0 && errno != EINTR) return 0;
    }
}

/* A connection to addr:port opened before the clock passes until: the socket, or -1 with errno
   saying why. */
static int dopt__tcp_open(const dopt__tcp *t, const unsigned char addr[16], uint32_t port, double until) {
    struct sockaddr_storage ss;
    socklen_t len = dopt__tcp_sockaddr(&ss, addr, port), elen = sizeof(int);
    int fd = dopt__tcp_new_socket(addr, t->sockbuf), err = 0;
    if (fd < 0) return -1;
    if (connect(fd, (struct sockaddr *)&ss, len) < 0) {
        err = errno;
        if (err == EINPROGRESS)
            err = !dopt__tcp_join_poll(fd, POLLOUT, until)                              ? ETIMEDOUT
                  : getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) < 0 ? errno
                                                                                        : err;
    }
    if (err) {
        close(fd);
        errno = err;
        return -1;
    }
    return fd;
}

/* Writes n bytes before the deadline: 0, or -1 (errno says why). */
static int dopt__tcp_put_all(int fd, const unsigned char *buf, size_t n, double deadline) {
    while (n > 0) {
        ssize_t k = send(fd, buf, n, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (k > 0) {
            buf += k;
            n -= (size_t)k;
        } else if (k < 0 && errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
            return -1;
        } else if (k < 0 && errno != EINTR && !dopt__tcp_join_poll(fd, POLLOUT, deadline)) {
            errno = ETIMEDOUT;
            return -1;
        }
    }
    return 0;
}

/* Reads n bytes before the deadline: 0, or -1 (errno says why; ECONNRESET for an end). */
static int dopt__tcp_get_all(int fd, unsigned char *buf, size_t n, double deadline) {
    while (n > 0) {
        ssize_t k = recv(fd, buf, n, MSG_DONTWAIT);
        if (k > 0) {
            buf += k;
            n -= (size_t)k;
        } else if (k == 0) {
            errno = ECONNRESET;
            return -1;
        } else if (errno != EINTR && errno != EAGAIN && errno != EWOULDBLOCK) {
            return -1;
        } else if (errno != EINTR && !dopt__tcp_join_poll(fd, POLLIN, deadline)) {
            errno = ETIMEDOUT;
            return -1;
        }
    }
    return 0;
}

/* One try at the member at addr:port. 1: held, *fd_out is the connection; 0: not (why says why);
   -1: the member refused the token or proved another (why says which). */
static int dopt__tcp_join_try(dopt__tcp *t, const unsigned char addr[16], uint32_t port, const unsigned char my_addr[16],
                              uint32_t my_port, double deadline, int answer_ms, int *fd_out, dopt__join_side *side,
                              char *why, size_t cap) {
    unsigned char nonce[DOPT__TCP_NONCE_BYTES], in[DOPT__TCP_JOIN_BYTES], out[DOPT__TCP_JOIN_BYTES];
    double now = dopt__now_ms(), until = now + DOPT__TCP_JOIN_CONNECT_MS < deadline ? now + DOPT__TCP_JOIN_CONNECT_MS : deadline;
    int fd, reply = 1, verdict = 0;
    if (dopt__join_nonce(nonce) < 0) return snprintf(why, cap, "no random bytes for a nonce (/dev/urandom)"), 0;
    fd = dopt__tcp_open(t, addr, port, until);
    if (fd < 0) return snprintf(why, cap, "cannot connect: %s", strerror(errno)), 0;
    dopt__join_ask_init(side, t->token, nonce, my_addr, my_port, out);
    until = now + answer_ms < deadline ? dopt__now_ms() + answer_ms : deadline;
    snprintf(why, cap, "no answer in %d ms", answer_ms);
    for (;;) {
        ssize_t n;
        if (reply) { /* 64 bytes on a connection that has carried at most 128: the buffer takes them */
            if (send(fd, out, sizeof out, MSG_NOSIGNAL) != (ssize_t)sizeof out) {
                snprintf(why, cap, "the connection ended: %s", strerror(errno));
                break;
            }
            reply = 0;
        }
        if (side->stage == DOPT__JOIN_HELD) {
            *fd_out = fd;
            return 1;
        }
        if (side->stage == DOPT__JOIN_REFUSED) {
            verdict = side->reason == DOPT__JOIN_WRONG_TOKEN || side->reason == 0 ? -1 : 0;
            snprintf(why, cap, "%s", side->why);
            break;
        }
        if (!dopt__tcp_join_poll(fd, POLLIN, until)) break;
        n = recv(fd, in, DOPT__TCP_JOIN_BYTES - side->got, MSG_DONTWAIT);
        if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) continue;
        if (n <= 0) {
            snprintf(why, cap, "the connection ended before an answer%s%s", n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
            break;
        }
        (void)dopt__join_feed(side, 0, in, (size_t)n, out, &reply);
    }
    close(fd);
    return verdict;
}

/* The joiner: asks the members at addr[i]:port[i] (i < n) until one holds it (DOPT_OK, *fd_out
   the connection, side the conversation: the member's epoch, size and rank), one refuses its
   token (AUTH) or the deadline passes (TIMEOUT, naming each member's last answer). It states
   my_addr:my_port as where it listens. */
DOPT__MAYBE_UNUSED static dopt_status dopt__tcp_join_reach(dopt_comm *c, const unsigned char (*addr)[16],
                                                           const uint32_t *port, int n, const unsigned char my_addr[16],
                                                           uint32_t my_port, double deadline, int *fd_out,
                                                           dopt__join_side *side) {
    dopt__tcp *t = (dopt__tcp *)c->impl;
    char why[DOPT__TCP_MAX_JOIN_ASKED][120], where[DOPT__TCP_ADDR_CHARS], all[DOPT_DETAIL_MAX / 2];
    int i, backoff = 100, asked = n < DOPT__TCP_MAX_JOIN_ASKED ? n : DOPT__TCP_MAX_JOIN_ASKED;
    size_t used;
    *fd_out = -1;
    if (n < 1) return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "a joiner needs the address of one member at least");
    for (;;) {
        for (i = 0; i < n; i++) {
            int r = dopt__tcp_join_try(t, addr[i], port[i], my_addr, my_port, deadline, c->timeout_ms, fd_out, side,
                                       why[i < asked ? i : asked - 1], sizeof why[0]);
            dopt__tcp_addr_str(addr[i], port[i], where, sizeof where);
            if (r > 0) {
                dopt_comm_log(c, DOPT_LOG_INFO, "joiner: held by rank %u of %u (epoch %u) at %s", (unsigned)side->rank,
                              (unsigned)side->size, (unsigned)side->epoch, where);
                return DOPT_OK;
            }
            if (r < 0)
                return dopt__tcp_setup_fail(c, DOPT_ERR_AUTH, "joiner: the member at %s: %s (is DOPT_TOKEN the job's?)",
                                            where, why[i < asked ? i : asked - 1]);
        }
        for (i = 0, used = 0; i < asked && used < sizeof all; i++) {
            dopt__tcp_addr_str(addr[i], port[i], where, sizeof where);
            used += (size_t)snprintf(all + used, sizeof all - used, "%s%s: %s", i ? "; " : "", where, why[i]);
        }
        if (dopt__now_ms() >= deadline)
            return dopt__tcp_setup_fail(c, DOPT_ERR_TIMEOUT, "joiner: no member held it in %d ms (%s)",
                                        t->rdv_timeout_ms, all);
        if (dopt__tcp_report_due(t))
            dopt_comm_log(c, DOPT_LOG_WARN, "joiner: no member holds it yet (%s; %d s)", all, dopt__tcp_waited_s(t));
        if (dopt__now_ms() + backoff > deadline) backoff = (int)(deadline - dopt__now_ms()) + 1;
        poll(NULL, 0, backoff);
        backoff = backoff * 2 > 1000 ? 1000 : backoff * 2;
    }
}

/* ===================================================================== RE-ADMIT: THE MEMBERS GROW

   dopt_comm_grow on a TCP communicator (distopt.h: TAKING A WORKER BACK). Each member states the
   joiners it holds (at most DOPT__TCP_MAX_JOINERS: where each listens and its nonce) in an
   allgather, so every member sees the same list: the joiners of rank 0 first, each member's in
   the order they were held. With K joiners in all, the grown communicator has n + K ranks, the
   members keep theirs and the joiners take n, n + 1, ... in that order; its epoch is the
   members' + 1. Each member sends its joiners ADMIT and the table (every rank's listening
   address, then each joiner's nonce) on the connection they were held on, and closes it. Then
   links: the members' links carry on into the grown communicator; every rank connects to each
   joiner above it and says who it is in a 40-byte hello whose proof is bound to that joiner's
   nonce, so that only the members (and joiners) of this grow can open it. A link that cannot be
   made is an ended one: the barrier that closes dopt_comm_grow then fails with PEER_LOST on
   every rank, and dopt_comm_shrink on the grown communicator leaves the joiner out again. */

#define DOPT__TCP_GROW_VERSION 1
#define DOPT__TCP_GROW_ENTRY 36 /* a joiner in the members' allgather: address 16, port 2, 2 zero, nonce 16 */
#define DOPT__TCP_GROW_RECORD (4 + DOPT__TCP_MAX_JOINERS * DOPT__TCP_GROW_ENTRY)

/* The hello that opens the link from `from` to `to` in the grown communicator (WIRE FORMAT): its
   proof is bound to the joiner's nonce when `to` is a joiner (nonce_to), to nothing more than the
   epoch and the two ranks when it is a member (NULL), so that a member checks it as soon as it
   arrives, before it knows the grown size. */
static void dopt__tcp_grow_hello(unsigned char out[DOPT__TCP_GROW_HELLO], const dopt__tcp *t,
                                 const unsigned char *nonce_to, uint32_t epoch, uint32_t size, int from, int to) {
    static const unsigned char none[DOPT__TCP_NONCE_BYTES] = {0};
    unsigned char stated[12];
    uint64_t key[2];
    memset(out, 0, DOPT__TCP_GROW_HELLO);
    memcpy(out, "DGRW", 4);
    dopt__put_le32(out + 4, DOPT__TCP_GROW_VERSION);
    dopt__put_le32(out + 8, epoch);
    dopt__put_le32(out + 12, size);
    dopt__put_le32(out + 16, (uint32_t)from);
    dopt__put_le32(out + 20, (uint32_t)to);
    dopt__put_le32(stated, epoch);
    dopt__put_le32(stated + 4, (uint32_t)from);
    dopt__put_le32(stated + 8, (uint32_t)to);
    dopt__join_key(t->token, key);
    dopt__join_proof(key, 'G', nonce_to ? nonce_to : none, none, stated, sizeof stated, out + 24);
}

/* A hello a member takes for the grow from epoch-1 to epoch: a rank below it, its proof right
   (size unchecked: unknown yet). */
static int dopt__tcp_grow_hello_ok(const dopt__tcp *t, const unsigned char *in, uint32_t epoch, const unsigned char *nonce) {
    unsigned char want[DOPT__TCP_GROW_HELLO];
    uint32_t from = dopt__get_le32(in + 16);
    if (memcmp(in, "DGRW", 4) != 0 || dopt__get_le32(in + 8) != epoch || dopt__get_le32(in + 20) != (uint32_t)t->rank ||
        from >= (uint32_t)t->rank)
        return 0;
    dopt__tcp_grow_hello(want, t, nonce, epoch, dopt__get_le32(in + 12), (int)from, t->rank);
    return dopt__tcp_same_bytes(want, in, sizeof want);
}

/* Takes the hellos of ranks 0 .. rank-1 of the grown communicator on lfd until the deadline,
   starting with the connections given (fd, what was read of each: got bytes); a rank that did
   not come gets an ended link (the barrier names it). nonce: the joiner's, NULL for a member. */
static void dopt__tcp_grow_accept(dopt_comm *c2, dopt__tcp *t2, int lfd, const unsigned char *nonce, double deadline,
                                  int *pend, unsigned char (*pbuf)[DOPT__TCP_GROW_HELLO], size_t *pgot, int np) {
    int got = 0, me = t2->rank, i, r;
    struct pollfd pf[DOPT__TCP_MAX_PENDING + 1];
    for (;;) {
        double left;
        int fd;
        for (i = np - 1; i >= 0; i--) { /* whole hellos: taken or refused */
            uint32_t from = dopt__get_le32(pbuf[i] + 16);
            int shrink = memcmp(pbuf[i], "DSHR", 4) == 0; /* a rank done with this grow already shrinks */
            if (pgot[i] < DOPT__TCP_GROW_HELLO && (pgot[i] < 4 || shrink || memcmp(pbuf[i], "DGRW", 4) == 0)) continue;
            if (shrink && pgot[i] == DOPT__TCP_SHRINK_HELLO && t2->nparked < DOPT__TCP_MAX_PENDING &&
                dopt__tcp_shrink_check_hello(c2, t2, pbuf[i]) >= 0) {
                t2->parked[t2->nparked] = pend[i]; /* for this rank's shrink of the grown communicator */
                memcpy(t2->parked_hello[t2->nparked++], pbuf[i], DOPT__TCP_SHRINK_HELLO);
            } else if (!shrink && pgot[i] == DOPT__TCP_GROW_HELLO && dopt__tcp_grow_hello_ok(t2, pbuf[i], c2->epoch, nonce) &&
                       dopt__get_le32(pbuf[i] + 12) == (uint32_t)t2->size && t2->peers[from].fd < 0) {
                t2->peers[from].fd = pend[i];
                got++;
            } else {
                dopt_comm_log(c2, DOPT_LOG_WARN, "rank %d: dopt_comm_grow: refused a connection: not a hello of this grow",
                              me);
                close(pend[i]);
            }
            np--;
            pend[i] = pend[np], pgot[i] = pgot[np];
            memcpy(pbuf[i], pbuf[np], DOPT__TCP_GROW_HELLO);
        }
        left = deadline - dopt__now_ms();
        if (got == me || left <= 0 || lfd < 0) break;
        pf[0].fd = lfd;
        pf[0].events = POLLIN;
        for (i = 0; i < np; i++) pf[i + 1].fd = pend[i], pf[i + 1].events = POLLIN;
        if (poll(pf, (nfds_t)np + 1, (int)left + 1) <= 0) continue;
        for (i = np - 1; i >= 0; i--) {
            ssize_t k;
            if (!pf[i + 1].revents) continue;
            k = recv(pend[i], pbuf[i] + pgot[i], DOPT__TCP_GROW_HELLO - pgot[i], MSG_DONTWAIT);
            if (k > 0) pgot[i] += (size_t)k;
            if (k == 0 || (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
                close(pend[i]);
                np--;
                pend[i] = pend[np], pgot[i] = pgot[np];
                memcpy(pbuf[i], pbuf[np], DOPT__TCP_GROW_HELLO);
            }
        }
        while ((fd = accept(lfd, NULL, NULL)) >= 0) {
            if (dopt__tcp_set_nonblocking(fd) < 0) {
                close(fd);
                continue;
            }
            if (np == DOPT__TCP_MAX_PENDING) { /* a flood: the oldest goes */
                close(pend[0]);
                np--;
                memmove(pend, pend + 1, sizeof pend[0] * (size_t)np);
                memmove(pgot, pgot + 1, sizeof pgot[0] * (size_t)np);
                memmove(pbuf, pbuf + 1, sizeof pbuf[0] * (size_t)np);
            }
            pend[np] = fd;
            pgot[np++] = 0;
        }
    }
    for (i = 0; i < np; i++) { /* not read whole: a survivor's hello, maybe, for the lobby (LINKS) to sort */
        if (t2->npend == DOPT__TCP_MAX_PENDING) {
            close(pend[i]);
            continue;
        }
        memset(&t2->pend[t2->npend], 0, sizeof t2->pend[0]);
        t2->pend[t2->npend].fd = pend[i];
        memcpy(t2->pend[t2->npend].rec, pbuf[i], pgot[i]);
        t2->pend[t2->npend++].got = pgot[i];
    }
    for (r = 0; r < me; r++)
        if (t2->peers[r].fd < 0) {
            dopt_comm_log(c2, DOPT_LOG_WARN, "rank %d: dopt_comm_grow: rank %d did not connect", me, r);
            t2->peers[r].fd = dopt__tcp_ended_link();
        }
}

/* Connects to addr:port and writes the hello; the connection, or -1 (why in why). */
static int dopt__tcp_grow_connect(const dopt__tcp *t, const unsigned char addr[16], uint32_t port,
                                  const unsigned char hello[DOPT__TCP_GROW_HELLO], double deadline, char *why,
                                  size_t cap) {
    int fd = dopt__tcp_open(t, addr, port, deadline);
    if (fd >= 0 && dopt__tcp_put_all(fd, hello, DOPT__TCP_GROW_HELLO, deadline) < 0) {
        int err = errno;
        close(fd);
        fd = -1;
        errno = err;
    }
    if (fd < 0) snprintf(why, cap, "%s", strerror(errno));
    return fd;
}

/* The last steps of a communicator a grow or a shrink made, on every rank: ready, the links'
   settings, the recorder's files, hosts, the progress thread. DOPT_OK, or why not (c2 destroyed). */
static dopt_status dopt__tcp_grown(dopt_comm *c2, dopt__tcp *t2, dopt__tcp *from) {
    dopt_status s;
    int p;
    t2->ready = 1;
    for (p = 0; p < t2->size; p++)
        if (p != t2->rank) {
            (void)dopt__tcp_set_nonblocking(t2->peers[p].fd);
            dopt__tcp_tune(t2->peers[p].fd, 0);
            dopt__tcp_keepalive(t2->peers[p].fd, t2->keepalive_s);
        }
    dopt__tcp_set_job(c2, t2);
    dopt_comm_set_host(c2, dopt__tcp_local_ranks(t2), (int)sysconf(_SC_NPROCESSORS_ONLN));
    if ((s = dopt__tcp_set_hosts(c2, t2, t2->two_level)) != DOPT_OK || (s = dopt__tcp_hb_take(c2, t2, from)) != DOPT_OK ||
        (t2->progress_thread_us > 0 && (s = dopt_comm_set_progress_thread(c2, t2->progress_thread_us)) != DOPT_OK))
        dopt_comm_destroy(c2);
    return s;
}

/* The table an ADMIT carries: size entries (DOPT__TCP_ENTRY_BYTES: where each rank listens),
   then the nonces of ranks members .. size-1. */
static size_t dopt__tcp_grow_table_bytes(uint32_t members, uint32_t size) {
    return (size_t)size * DOPT__TCP_ENTRY_BYTES + (size_t)(size - members) * DOPT__TCP_NONCE_BYTES;
}

static dopt_status dopt__tcp_grow(dopt_comm *c, dopt_comm **next) {
    dopt__tcp *t = (dopt__tcp *)c->impl, *t2;
    int n = t->size, me = t->rank, held[DOPT__TCP_MAX_JOINERS], nh = 0, K = 0, before = 0, r, i, j, q, N, np = 0;
    unsigned char mine[DOPT__TCP_GROW_RECORD], *all, *table = NULL, rec[DOPT__TCP_JOIN_BYTES], hello[DOPT__TCP_GROW_HELLO];
    unsigned char pbuf[DOPT__TCP_MAX_PENDING][DOPT__TCP_GROW_HELLO];
    int pend[DOPT__TCP_MAX_PENDING];
    size_t pgot[DOPT__TCP_MAX_PENDING], table_bytes;
    char token[DOPT_TCP_TOKEN_MAX + 1], why[128], where[DOPT__TCP_ADDR_CHARS];
    double deadline;
    dopt_tcp_config k;
    dopt_comm *c2 = NULL;
    dopt__join_rec admit;
    dopt_status s;
    *next = NULL;
    for (j = 0; j < t->njoiners; j++) /* held ones, oldest first */
        if (t->joiners[j].side.stage == DOPT__JOIN_HELD) {
            for (i = nh++; i > 0 && t->joiners[held[i - 1]].since > t->joiners[j].since; i--) held[i] = held[i - 1];
            held[i] = j;
        }
    memset(mine, 0, sizeof mine);
    dopt__put_le32(mine, (uint32_t)nh);
    for (i = 0; i < nh; i++) {
        const dopt__tcp_joiner *jn = &t->joiners[held[i]];
        unsigned char *e = mine + 4 + (size_t)i * DOPT__TCP_GROW_ENTRY;
        memcpy(e, dopt__tcp_is_any(jn->side.addr) ? jn->from : jn->side.addr, 16); /* a wildcard: where it came from */
        dopt__put_le16(e + 16, jn->side.port);
        memcpy(e + 20, jn->side.nonce_j, DOPT__TCP_NONCE_BYTES);
    }
    all = (unsigned char *)DOPT_MALLOC((size_t)n * DOPT__TCP_GROW_RECORD);
    if (all == NULL) return dopt_comm_fail(c, NULL, DOPT_ERR_NOMEM, "rank %d: dopt_comm_grow: out of memory", me);
    s = dopt_allgather(c, mine, all, DOPT__TCP_GROW_RECORD);
    for (r = 0; r < n && s == DOPT_OK; r++) {
        uint32_t kr = dopt__get_le32(all + (size_t)r * DOPT__TCP_GROW_RECORD);
        if (kr > DOPT__TCP_MAX_JOINERS)
            s = dopt_comm_fail(c, NULL, DOPT_ERR_PROTOCOL, "rank %d: dopt_comm_grow: rank %d states %u joiners", me, r,
                               (unsigned)kr);
        if (r < me) before += (int)kr;
        K += (int)kr;
    }
    if (s != DOPT_OK || K == 0) {
        DOPT_FREE(all);
        return s;
    }
    N = n + K;
    table_bytes = dopt__tcp_grow_table_bytes((uint32_t)n, (uint32_t)N);
    table = (unsigned char *)DOPT_MALLOC(table_bytes);
    dopt__tcp_like(c, t, me, N, token, &k);
    if (table == NULL || (s = dopt__tcp_new(&c2, &k)) != DOPT_OK) {
        DOPT_FREE(all);
        DOPT_FREE(table);
        return dopt_comm_fail(c, NULL, DOPT_ERR_NOMEM, "rank %d: dopt_comm_grow: out of memory", me);
    }
    t2 = (dopt__tcp *)c2->impl;
    c2->epoch = c->epoch + 1;
    c2->grown_from = n;
    memset(table, 0, table_bytes);
    for (q = 0; q < n; q++) {
        memcpy(t2->peers[q].addr, t->peers[q].addr, 16);
        t2->peers[q].port = t->peers[q].port;
    }
    for (r = 0, q = n; r < n; r++)
        for (i = 0; i < (int)dopt__get_le32(all + (size_t)r * DOPT__TCP_GROW_RECORD); i++, q++) {
            const unsigned char *e = all + (size_t)r * DOPT__TCP_GROW_RECORD + 4 + (size_t)i * DOPT__TCP_GROW_ENTRY;
            memcpy(t2->peers[q].addr, e, 16);
            t2->peers[q].port = dopt__get_le16(e + 16);
            memcpy(table + (size_t)N * DOPT__TCP_ENTRY_BYTES + (size_t)(q - n) * DOPT__TCP_NONCE_BYTES, e + 20,
                   DOPT__TCP_NONCE_BYTES);
        }
    DOPT_FREE(all);
    for (q = 0; q < N; q++) {
        memcpy(table + (size_t)q * DOPT__TCP_ENTRY_BYTES, t2->peers[q].addr, 16);
        dopt__put_le16(table + (size_t)q * DOPT__TCP_ENTRY_BYTES + 16, t2->peers[q].port);
    }
    deadline = dopt__now_ms() + c->timeout_ms;
    memset(&admit, 0, sizeof admit);
    admit.type = DOPT__JOIN_ADMIT;
    admit.epoch = c2->epoch;
    admit.size = (uint32_t)N;
    admit.members = (uint32_t)n;
    for (i = 0; i < nh; i++) { /* a joiner that does not take it fails to link below */
        dopt__tcp_joiner *jn = &t->joiners[held[i]];
        admit.rank = (uint32_t)(n + before + i);
        dopt__join_encode(rec, &admit);
        if (dopt__tcp_put_all(jn->fd, rec, sizeof rec, deadline) < 0 || dopt__tcp_put_all(jn->fd, table, table_bytes, deadline) < 0)
            dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: dopt_comm_grow: joiner %d did not take its admission: %s", me,
                          n + before + i, strerror(errno));
        jn->side.stage = DOPT__JOIN_REFUSED; /* done with: closed below */
    }
    for (j = t->njoiners - 1; j >= 0; j--)
        if (t->joiners[j].side.stage == DOPT__JOIN_REFUSED) {
            close(t->joiners[j].fd);
            t->joiners[j] = t->joiners[--t->njoiners];
        }
    /* fresh links, as a shrink makes them: c's stay c's, so that a member still finishing the
       allgather on them never reads a frame of the grown communicator */
    for (q = me + 1; q < N; q++) {
        dopt__tcp_grow_hello(hello, t2, q >= n ? table + (size_t)N * DOPT__TCP_ENTRY_BYTES + (size_t)(q - n) * DOPT__TCP_NONCE_BYTES : NULL,
                             c2->epoch, (uint32_t)N, me, q);
        t2->peers[q].fd = dopt__tcp_grow_connect(t2, t2->peers[q].addr, t2->peers[q].port, hello, deadline, why, sizeof why);
        if (t2->peers[q].fd < 0) {
            dopt__tcp_addr_str(t2->peers[q].addr, t2->peers[q].port, where, sizeof where);
            dopt_comm_log(c, DOPT_LOG_WARN, "rank %d: dopt_comm_grow: no link to %s %d at %s: %s", me,
                          q >= n ? "joiner" : "rank", q, where, why);
            t2->peers[q].fd = dopt__tcp_ended_link();
        }
    }
    DOPT_FREE(table);
    for (i = 0; i < t->ngparked; i++) { /* hellos the lobby took during the allgather */
        pend[np] = t->gparked[i];
        memcpy(pbuf[np], t->gparked_hello[i], DOPT__TCP_GROW_HELLO);
        pgot[np++] = DOPT__TCP_GROW_HELLO;
    }
    t->ngparked = 0;
    for (r = t->npend - 1; r >= 0 && np < DOPT__TCP_MAX_PENDING; r--) { /* accepted there, not read whole yet */
        dopt__tcp_pending *pq = &t->pend[r];
        if (pq->got >= 4 && memcmp(pq->rec, "DGRW", 4) != 0) continue;
        pend[np] = pq->fd;
        memcpy(pbuf[np], pq->rec, pq->got);
        pgot[np++] = pq->got;
        *pq = t->pend[--t->npend];
    }
    dopt__tcp_grow_accept(c2, t2, dopt__tcp_member_lfd(t), NULL, deadline, pend, pbuf, pgot, np);
    /* what listens for joiners and survivors, and who waits there, is the grown communicator's */
    t2->lfd = t->lfd, t->lfd = -1;
    t2->shrink_lfd = t->shrink_lfd, t->shrink_lfd = -1;
    for (i = 0; i < t->npend; i++) { /* strangers, rendezvous latecomers: the lobby's */
        if (t2->npend < DOPT__TCP_MAX_PENDING)
            t2->pend[t2->npend++] = t->pend[i];
        else
            close(t->pend[i].fd);
    }
    t->npend = 0;
    for (i = 0; i < t->nparked; i++) /* hellos for a shrink of the grown communicator wait there; c's are stale */
        if (dopt__get_le32(t->parked_hello[i] + 8) == c2->epoch && t2->nparked < DOPT__TCP_MAX_PENDING) {
            t2->parked[t2->nparked] = t->parked[i];
            memcpy(t2->parked_hello[t2->nparked++], t->parked_hello[i], DOPT__TCP_SHRINK_HELLO);
        } else {
            close(t->parked[i]);
        }
    t->nparked = 0;
    t2->joiners = t->joiners, t2->njoiners = t->njoiners, t->joiners = NULL, t->njoiners = 0;
    t->ready = 0, t->shrunk = 1; /* c's destroy just closes its links: every rank has left c (barrier below) */
    if ((s = dopt__tcp_grown(c2, t2, t)) != DOPT_OK)
        return dopt_comm_fail(c, NULL, s, "rank %d: dopt_comm_grow: cannot set up the grown communicator", me);
    if (K == 1)
        snprintf(why, sizeof why, "rank %d", n);
    else
        snprintf(why, sizeof why, "ranks %d to %d", n, N - 1);
    dopt_comm_log(c2, DOPT_LOG_INFO, "tcp rank %d of %d: took %d joiner%s as %s, epoch %u", me, N, K, K == 1 ? "" : "s",
                  why, (unsigned)c2->epoch);
    *next = c2;
    return dopt_barrier(c2); /* every link works, or PEER_LOST names the rank that is not there */
}

/* ===================================================================== RE-ADMIT: THE JOINER COMES IN

   dopt_tcp_create with join: the joiner listens (on bind_addr or socket_ifname's address, else on
   every address of rank 0's family, and the members reach it where its connection came from),
   asks the members (THE JOINER ASKS), and once held waits for the ADMIT its member sends when the
   members call dopt_comm_grow — until the rendezvous deadline; a member that goes meanwhile
   sends it to ask again. Then it takes the hellos of every rank below it, connects to the
   joiners above it, and ends with the members in the barrier of dopt_comm_grow. */

/* The members a joiner asks: rank 0's address, then join_peers. */
static dopt_status dopt__tcp_join_list(dopt_comm *c, const dopt_tcp_config *cfg, int master_port,
                                       unsigned char (*addr)[16], uint32_t *port, int cap, int *n) {
    char host[DOPT__TCP_HOST_MAX], item[DOPT__TCP_HOST_MAX + 16];
    const char *p = cfg->join_peers, *why;
    dopt_status s = dopt__tcp_resolve(c, cfg->master_addr ? cfg->master_addr : "127.0.0.1", addr[0]);
    int attached;
    if (s != DOPT_OK) return s;
    port[0] = (uint32_t)master_port;
    *n = 1;
    while (p && *p && *n < cap) {
        size_t len = strcspn(p, ",");
        snprintf(item, sizeof item, "%.*s", (int)(len < sizeof item ? len : sizeof item - 1), p);
        p += len + (p[len] == ',');
        if (item[0] == '\0') continue;
        why = dopt__tcp_split_addr(item, host, sizeof host, &attached);
        if (why == NULL && attached == 0) why = "has no port";
        if (why) return dopt__tcp_setup_fail(c, DOPT_ERR_INVALID, "join_peers: \"%s\" %s", item, why);
        if ((s = dopt__tcp_resolve(c, host, addr[*n])) != DOPT_OK) return s;
        port[(*n)++] = (uint32_t)attached;
    }
    return DOPT_OK;
}

static dopt_status dopt__tcp_join_job(dopt_comm **out, const dopt_tcp_config *cfg, int master_port) {
    unsigned char addr[1 + DOPT__TCP_MAX_JOIN_ASKED * 4][16], my_addr[16], rec[DOPT__TCP_JOIN_BYTES], *table = NULL;
    uint32_t port[1 + DOPT__TCP_MAX_JOIN_ASKED * 4], my_port = 0;
    char token[DOPT_TCP_TOKEN_MAX + 1], why[128];
    int n = 0, lfd = -1, fd = -1, q;
    size_t table_bytes = 0;
    dopt_tcp_config k = *cfg;
    dopt_comm *c = NULL, *c2 = NULL;
    dopt__tcp *t, *t2;
    dopt__join_side side;
    dopt__join_rec admit;
    double deadline;
    dopt_status s;
    k.rank = 0;
    k.world_size = 1;
    k.min_ranks = 0;
    if ((s = dopt__tcp_new(&c, &k)) != DOPT_OK) return s;
    t = (dopt__tcp *)c->impl;
    t->setup_start = dopt__now_ms();
    t->next_report = t->setup_start + t->report_ms;
    deadline = t->setup_start + (double)t->rdv_timeout_ms;
    s = dopt__tcp_join_list(c, cfg, master_port, addr, port, (int)(sizeof port / sizeof port[0]), &n);
    if (s == DOPT_OK && (cfg->bind_addr || cfg->socket_ifname))
        s = dopt__tcp_rank_addr(c, cfg, addr[0], -1, "the members", my_addr);
    else if (s == DOPT_OK) { /* every address of rank 0's family */
        memset(my_addr, 0, 16);
        if (dopt__tcp_is_v4(addr[0])) memcpy(my_addr, dopt__tcp_v4_prefix, 12);
    }
    if (s == DOPT_OK) s = dopt__tcp_listen(c, t, my_addr, (uint32_t)cfg->listen_port, &lfd, &my_port);
    while (s == DOPT_OK) {
        s = dopt__tcp_join_reach(c, (const unsigned char(*)[16])addr, port, n, my_addr, my_port, deadline, &fd, &side);
        if (s != DOPT_OK) break;
        if (dopt__tcp_get_all(fd, rec, sizeof rec, deadline) == 0) break;
        if (errno == ETIMEDOUT)
            s = dopt__tcp_setup_fail(c, DOPT_ERR_TIMEOUT, "joiner: held by rank %u of %u but not taken in within %d ms "
                                     "(do the members call dopt_comm_grow, e.g. the driver with elastic = 1?)",
                                     (unsigned)side.rank, (unsigned)side.size, t->rdv_timeout_ms);
        else
            dopt_comm_log(c, DOPT_LOG_INFO, "joiner: rank %u, which held it, is gone (%s); asking again",
                          (unsigned)side.rank, strerror(errno));
        close(fd);
        fd = -1;
    }
    if (s == DOPT_OK) {
        const char *bad = dopt__join_decode(rec, &admit);
        if (bad == NULL && admit.type != DOPT__JOIN_ADMIT) bad = "not an admission";
        if (bad) s = dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL, "joiner: rank %u's admission: %s", (unsigned)side.rank, bad);
    }
    if (s == DOPT_OK) {
        table_bytes = dopt__tcp_grow_table_bytes(admit.members, admit.size);
        if ((table = (unsigned char *)DOPT_MALLOC(table_bytes)) == NULL)
            s = dopt__tcp_setup_fail(c, DOPT_ERR_NOMEM, "joiner: cannot allocate the members' table");
        else if (dopt__tcp_get_all(fd, table, table_bytes, deadline) < 0)
            s = dopt__tcp_setup_fail(c, DOPT_ERR_PEER_LOST, "joiner: rank %u's table did not come: %s",
                                     (unsigned)side.rank, strerror(errno));
    }
    if (fd >= 0) close(fd);
    if (s == DOPT_OK) {
        dopt__tcp_like(c, t, (int)admit.rank, (int)admit.size, token, &k);
        k.min_ranks = cfg->min_ranks < (int)admit.size ? cfg->min_ranks : (int)admit.size;
        if ((s = dopt__tcp_new(&c2, &k)) != DOPT_OK) s = dopt__tcp_setup_fail(c, s, "joiner: cannot make its communicator");
    }
    for (q = 0; s == DOPT_OK && q < (int)admit.size; q++) {
        const char *bad = dopt__tcp_entry_decode(table + (size_t)q * DOPT__TCP_ENTRY_BYTES, ((dopt__tcp *)c2->impl)->peers[q].addr,
                                                 &((dopt__tcp *)c2->impl)->peers[q].port);
        if (bad) s = dopt__tcp_setup_fail(c, DOPT_ERR_PROTOCOL, "joiner: the members' table, entry %d: %s", q, bad);
    }
    if (s == DOPT_OK) {
        const unsigned char *nonces = table + (size_t)admit.size * DOPT__TCP_ENTRY_BYTES;
        double links_by = dopt__now_ms() + c->timeout_ms;
        unsigned char hello[DOPT__TCP_GROW_HELLO], pbuf[DOPT__TCP_MAX_PENDING][DOPT__TCP_GROW_HELLO];
        int pend[DOPT__TCP_MAX_PENDING];
        size_t pgot[DOPT__TCP_MAX_PENDING];
        t2 = (dopt__tcp *)c2->impl;
        c2->epoch = admit.epoch;
        c2->grown_from = (int)admit.members;
        dopt__tcp_grow_accept(c2, t2, lfd, side.nonce_j, links_by, pend, pbuf, pgot, 0);
        for (q = (int)admit.rank + 1; q < (int)admit.size; q++) { /* the joiners above */
            dopt__tcp_grow_hello(hello, t2, nonces + (size_t)(q - (int)admit.members) * DOPT__TCP_NONCE_BYTES,
                                 admit.epoch, admit.size, (int)admit.rank, q);
            t2->peers[q].fd = dopt__tcp_grow_connect(t2, t2->peers[q].addr, t2->peers[q].port, hello, links_by, why, sizeof why);
            if (t2->peers[q].fd < 0) {
                dopt_comm_log(c2, DOPT_LOG_WARN, "joiner: no link to joiner %d: %s", q, why);
                t2->peers[q].fd = dopt__tcp_ended_link();
            }
        }
        t2->shrink_lfd = lfd; /* where it listens for later joiners and shrinks, like every member */
        lfd = -1;
        s = dopt__tcp_grown(c2, t2, NULL);
        if (s != DOPT_OK) {
            c2 = NULL;
            s = dopt__tcp_setup_fail(c, s, "joiner: cannot set up its communicator");
        }
    }
    DOPT_FREE(table);
    if (lfd >= 0) close(lfd);
    if (s != DOPT_OK) {
        dopt_comm_log(c, DOPT_LOG_ERROR, "%s", c->detail);
        if (c2) dopt_comm_destroy(c2);
        dopt_comm_destroy(c);
        return s;
    }
    dopt_comm_destroy(c);
    dopt_comm_log(c2, DOPT_LOG_INFO, "tcp rank %d of %d: taken back by the job, epoch %u", c2->rank, c2->size,
                  (unsigned)c2->epoch);
    s = dopt_barrier(c2); /* the members' dopt_comm_grow ends with it */
    if (s != DOPT_OK) {
        dopt_comm_log(c2, DOPT_LOG_ERROR, "joiner: %s", dopt_comm_detail(c2));
        dopt_comm_destroy(c2);
        return s;
    }
    *out = c2;
    return DOPT_OK;
}

/* ===================================================================== ENVIRONMENT */

static dopt_status dopt__tcp_env_error(const dopt_tcp_config *cfg, const char *fmt, ...) DOPT_PRINTF(2, 3);
static dopt_status dopt__tcp_env_error(const dopt_tcp_config *cfg, const char *fmt, ...) {
    char msg[DOPT_DETAIL_MAX];
    va_list ap;
    if (cfg->log_fn) {
        va_start(ap, fmt);
        vsnprintf(msg, sizeof msg, fmt, ap);
        va_end(ap);
        cfg->log_fn(cfg->log_user, DOPT_LOG_ERROR, msg);
    }
    return DOPT_ERR_INVALID;
}

/* One integer variable: 1 when set (into *value), 0 when unset or empty, -1 when it is not a
   number in [lo, hi] (said through cfg->log_fn). */
static int dopt__tcp_env_int(const dopt_tcp_config *cfg, const char *name, long lo, long hi, int *value) {
    char why[160];
    long v;
    int found = dopt__env_long(name, lo, hi, &v, why, sizeof why);
    if (found < 0) return dopt__tcp_env_error(cfg, "%s", why), -1;
    if (found) *value = (int)v;
    return found;
}

/* Rank 0's address as the environment gives it may carry its port ("host:29500",
   "[fd00::1]:29500"): it then stands for the port, which a port variable, when set too, must
   repeat (a port derived from the job's name gives way). -1 when it does not parse or agree (said
   through cfg->log_fn). */
static int dopt__tcp_env_master_port(const dopt_tcp_config *cfg, const dopt_launch_info *info, int *port) {
    char host[DOPT__TCP_HOST_MAX];
    const char *text = info->master_addr, *why;
    const char *addr_var = strncmp(info->master_from, "DOPT_MASTER_ADDR", 16) ? "MASTER_ADDR" : "DOPT_MASTER_ADDR";
    const char *port_var = dopt__env_set("DOPT_MASTER_PORT") ? "DOPT_MASTER_PORT"
                           : dopt__env_set("MASTER_PORT")    ? "MASTER_PORT"
                                                             : NULL;
    int attached;
    if (*text == '\0') return 0;
    why = dopt__tcp_split_addr(text, host, sizeof host, &attached);
    if (why) return dopt__tcp_env_error(cfg, "%s=\"%s\" %s", addr_var, text, why), -1;
    if (attached && port_var && attached != *port)
        return dopt__tcp_env_error(cfg, "%s=\"%s\" names port %d but %s=%d", addr_var, text, attached, port_var,
                                   *port),
               -1;
    if (attached) *port = attached;
    return 0;
}

DOPT_DEF dopt_status dopt_tcp_config_from_env(dopt_tcp_config *cfg) {
    dopt_tcp_config env;
    dopt_launch_info info;
    char why[DOPT_DETAIL_MAX];
    const char *s;
    if (cfg == NULL) return DOPT_ERR_INVALID;
    env = *cfg;
    if (dopt_launch_read(&info, why, sizeof why) != DOPT_OK) return dopt__tcp_env_error(cfg, "%s", why);
    if (dopt__tcp_env_int(cfg, "DOPT_TIMEOUT_MS", 1, INT_MAX, &env.timeout_ms) < 0 ||
        dopt__tcp_env_int(cfg, "DOPT_RENDEZVOUS_TIMEOUT_MS", 1, INT_MAX, &env.rendezvous_timeout_ms) < 0 ||
        dopt__tcp_env_int(cfg, "DOPT_PROGRESS_THREAD_US", 0, INT_MAX, &env.progress_thread_us) < 0 ||
        dopt__tcp_env_int(cfg, "DOPT_MIN_RANKS", 0, INT_MAX, &env.min_ranks) < 0 ||
        dopt__tcp_env_int(cfg, "DOPT_KEEPALIVE_S", -1, DOPT__TCP_KEEPALIVE_MAX_S, &env.keepalive_s) < 0 ||
        dopt__tcp_env_int(cfg, "DOPT_JOIN", 0, 1, &env.join) < 0 ||
        dopt__tcp_env_int(cfg, "DOPT_LISTEN_PORT", 0, 65535, &env.listen_port) < 0 ||
        dopt__tcp_env_int(cfg, "DOPT_DEAD_AFTER_MS", 0, INT_MAX, &env.dead_after_ms) < 0)
        return DOPT_ERR_INVALID;
    s = getenv("DOPT_JOIN_PEERS");
    if (s && *s) env.join_peers = s;
    s = getenv("DOPT_ON_PEER_LOST");
    if (s && *s) {
        if (strcmp(s, "fail") == 0)
            env.on_peer_lost = DOPT_FAIL;
        else if (strcmp(s, "shrink") == 0)
            env.on_peer_lost = DOPT_SHRINK;
        else
            return dopt__tcp_env_error(cfg, "DOPT_ON_PEER_LOST=\"%s\" is not fail or shrink", s);
    }
    if (env.join) { /* the job gives the rank and size */
        info.rank = 0;
        if (info.world_size < 1) info.world_size = 1;
    }
    if (info.rank < 0)
        return dopt__tcp_env_error(cfg, "DOPT_RANK is not set (every rank needs it; or start the job with a launcher "
                                        "that sets it: mpirun, srun, torchrun)");
    env.rank = info.rank;
    env.world_size = info.world_size;
    env.master_addr = NULL;
    env.master_host[0] = '\0';
    if (info.master_addr[0]) {
        snprintf(env.master_host, sizeof env.master_host, "%s", info.master_addr);
    } else if (info.local_size > 0 && info.local_size < info.world_size) {
        return dopt__tcp_env_error(cfg, "rank 0's address is unknown: %s's variables put %d of the %d ranks on this "
                                        "host and none names rank 0's host; set DOPT_MASTER_ADDR to it (mpirun: -x "
                                        "DOPT_MASTER_ADDR=<host>)",
                                   info.launcher, info.local_size, info.world_size);
    }
    env.master_port = info.master_port;
    if (dopt__tcp_env_master_port(cfg, &info, &env.master_port) < 0) return DOPT_ERR_INVALID;
    if (env.master_port == 0 && env.join)
        return dopt__tcp_env_error(cfg, "DOPT_MASTER_PORT is not set: a joiner (DOPT_JOIN=1) asks rank 0 first");
    if (env.master_port == 0 && env.world_size > 1 && env.rank > 0)
        return dopt__tcp_env_error(cfg, "DOPT_MASTER_PORT is not set: rank %d needs rank 0's port", env.rank);
    if (env.master_port == 0 && env.world_size > 1 && env.on_listen == NULL)
        return dopt__tcp_env_error(cfg, "DOPT_MASTER_PORT is not set: the other ranks need rank 0's port");
    s = getenv("DOPT_TWO_LEVEL");
    if (s && *s) {
        if (strcmp(s, "auto") == 0)
            env.two_level = DOPT_TWO_LEVEL_AUTO;
        else if (strcmp(s, "on") == 0)
            env.two_level = DOPT_TWO_LEVEL_ON;
        else if (strcmp(s, "off") == 0)
            env.two_level = DOPT_TWO_LEVEL_OFF;
        else
            return dopt__tcp_env_error(cfg, "DOPT_TWO_LEVEL=\"%s\" is not auto, on or off", s);
    }
    s = getenv("DOPT_BIND_ADDR");
    env.bind_addr = s && *s ? s : NULL;
    s = getenv("DOPT_SOCKET_IFNAME");
    env.socket_ifname = s && *s ? s : NULL;
    s = getenv("DOPT_TOKEN");
    env.token = s && *s ? s : NULL;
    if (env.token && strlen(env.token) > DOPT_TCP_TOKEN_MAX)
        return dopt__tcp_env_error(cfg, "DOPT_TOKEN is %lu bytes long, more than %d", (unsigned long)strlen(env.token),
                                   DOPT_TCP_TOKEN_MAX);
    *cfg = env;
    return DOPT_OK;
}

DOPT_DEF dopt_status dopt_tcp_create_from_env(dopt_comm **out, const dopt_tcp_config *base) {
    dopt_tcp_config cfg;
    dopt_status s;
    if (out) *out = NULL;
    if (base)
        cfg = *base;
    else
        memset(&cfg, 0, sizeof cfg);
    s = dopt_tcp_config_from_env(&cfg);
    if (s != DOPT_OK) return s;
    return dopt_tcp_create(out, &cfg);
}

#ifdef __cplusplus
}
#endif

#endif /* DISTOPT_IMPLEMENTATION && !DOPT__TCP_IMPLEMENTED */
