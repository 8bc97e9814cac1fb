//! `TestCluster`: a Redis Cluster of three primaries and three replicas on
//! 127.0.0.1, started by the test, with the failures and reshardings tests
//! need: kill and restart a node, wait for a failover, move a slot live.
//!
//! Every method blocks (plain redis-rs connections, bounded waits); from
//! async code call the long ones (`wait_for_failover`, `migrate_slot`,
//! `restart`) through `tokio::task::spawn_blocking` with the cluster in an
//! `Arc`, so traffic keeps running meanwhile.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::ops::RangeInclusive;
use std::path::Path;
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::process::{
    connect, field, fields, free_cluster_port, run_bounded, wait_for, RedisProcess,
    TOPOLOGY_DEADLINE,
};

/// The number of hash slots of a Redis Cluster.
pub const SLOTS: u16 = 16384;

/// The hash slot of a key, as Redis computes it: CRC16 (XMODEM) of the key,
/// or of its hash tag (the text between the first `{` and the next `}`, when
/// not empty), modulo 16384.
pub fn key_slot(key: impl AsRef<[u8]>) -> u16 {
    let key = key.as_ref();
    let hashed = key
        .iter()
        .position(|&b| b == b'{')
        .and_then(|open| {
            let rest = &key[open + 1..];
            let len = rest.iter().position(|&b| b == b'}')?;
            (len > 0).then(|| &rest[..len])
        })
        .unwrap_or(key);
    crc16::State::<crc16::XMODEM>::calculate(hashed) % SLOTS
}

/// One node of a [`TestCluster`], named by its port (stable across roles,
/// kills and restarts).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Node {
    pub port: u16,
}

impl Node {
    /// `redis://127.0.0.1:PORT/`
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// `127.0.0.1:PORT`
    pub fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }
}

/// What a node is in the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Primary,
    Replica,
}

/// A node as the cluster sees it (one line of `CLUSTER NODES`).
#[derive(Clone, Debug)]
pub struct NodeInfo {
    pub node: Node,
    /// The cluster's 40-character node id.
    pub id: String,
    pub role: Role,
    /// The node id of its primary, for a replica.
    pub primary_id: Option<String>,
    /// The slots it serves (a primary's).
    pub slots: Vec<RangeInclusive<u16>>,
    /// Flagged `fail` or `fail?` by the node that was asked.
    pub failing: bool,
    /// Whether the fixture's process of this node runs (not killed).
    pub running: bool,
}

impl NodeInfo {
    pub fn serves(&self, slot: u16) -> bool {
        self.slots.iter().any(|r| r.contains(&slot))
    }
}

/// Three primaries and three replicas (`--cluster-replicas 1`), each a
/// `redis-server` of its own on a free port whose bus port (+10000) is free
/// too, in a temporary directory removed on drop.
pub struct TestCluster {
    /// Sorted; `procs[i]` runs `ports[i]`.
    ports: Vec<u16>,
    procs: Mutex<Vec<RedisProcess>>,
    /// What a killed primary served when it was killed.
    killed_slots: Mutex<HashMap<u16, Vec<RangeInclusive<u16>>>>,
    /// Last, so it is removed after the processes have stopped.
    dir: tempfile::TempDir,
}

const NODES: usize = 6;

fn node_args(port: u16, dir: &Path) -> String {
    let dir = dir.display();
    format!(
        "--port {port} --bind 127.0.0.1 --cluster-enabled yes \
         --cluster-config-file '{dir}/nodes-{port}.conf' --cluster-node-timeout 1000 \
         --cluster-replica-validity-factor 0 --save '' --appendonly no \
         --dir '{dir}' --dbfilename 'dump-{port}.rdb' --repl-diskless-sync-delay 0 \
         --loglevel notice"
    )
}

fn log_path(port: u16, dir: &Path) -> std::path::PathBuf {
    dir.join(format!("node-{port}.log"))
}

fn pings(port: u16) -> bool {
    connect(&format!("redis://127.0.0.1:{port}/"))
        .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
        .is_ok()
}

/// Parses `CLUSTER NODES`.
fn parse_nodes(text: &str) -> Vec<NodeInfo> {
    text.lines()
        .filter_map(|line| {
            let parts: Vec<&str> = line.split_whitespace().collect();
            if parts.len() < 8 {
                return None;
            }
            let port = parts[1]
                .split('@')
                .next()?
                .rsplit(':')
                .next()?
                .parse()
                .unwrap_or(0);
            let flags: Vec<&str> = parts[2].split(',').collect();
            let role = if flags.contains(&"slave") {
                Role::Replica
            } else {
                Role::Primary
            };
            let slots = parts[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .filter_map(|s| match s.split_once('-') {
                    Some((a, b)) => Some(a.parse().ok()?..=b.parse().ok()?),
                    None => {
                        let n = s.parse().ok()?;
                        Some(n..=n)
                    }
                })
                .collect();
            Some(NodeInfo {
                node: Node { port },
                id: parts[0].to_string(),
                role,
                primary_id: (parts[3] != "-").then(|| parts[3].to_string()),
                slots,
                failing: flags.iter().any(|f| *f == "fail" || *f == "fail?"),
                running: false,
            })
        })
        .collect()
}

impl TestCluster {
    /// Starts six nodes, creates the cluster with `redis-cli --cluster
    /// create`, and waits until every node reports `cluster_state:ok` with
    /// all 16384 slots, all agree on who serves what, and every replica is
    /// in sync. Panics (with the nodes' logs) when that takes longer than
    /// [`TOPOLOGY_DEADLINE`].
    pub fn start() -> TestCluster {
        let dir = tempfile::Builder::new()
            .prefix("redis-cluster-")
            .tempdir()
            .expect("create a temporary directory for the cluster");
        let mut ports: Vec<u16> = (0..NODES).map(|_| free_cluster_port()).collect();
        ports.sort_unstable();
        let mut procs: Vec<RedisProcess> = ports
            .iter()
            .map(|&p| RedisProcess::spawn(&node_args(p, dir.path()), &log_path(p, dir.path())))
            .collect();
        // Up, each; a node that lost its port to another process moves to a
        // fresh one (only here, before the cluster knows its address).
        let deadline = Instant::now() + TOPOLOGY_DEADLINE;
        for i in 0..NODES {
            loop {
                if pings(ports[i]) {
                    break;
                }
                if procs[i].failed_to_bind() {
                    procs[i].kill();
                    ports[i] = free_cluster_port();
                    procs[i] = RedisProcess::spawn(
                        &node_args(ports[i], dir.path()),
                        &log_path(ports[i], dir.path()),
                    );
                    continue;
                }
                assert!(
                    Instant::now() < deadline,
                    "cluster node on port {} did not start within {TOPOLOGY_DEADLINE:?}\n{}",
                    ports[i],
                    procs[i].log_tail(30)
                );
                std::thread::sleep(super::process::POLL);
            }
        }
        let mut started: Vec<(u16, RedisProcess)> = ports.into_iter().zip(procs).collect();
        started.sort_by_key(|(port, _)| *port);
        let (ports, procs): (Vec<u16>, Vec<RedisProcess>) = started.into_iter().unzip();

        let mut create = Command::new("redis-cli");
        create.arg("--cluster").arg("create");
        for port in &ports {
            create.arg(format!("127.0.0.1:{port}"));
        }
        create.args(["--cluster-replicas", "1", "--cluster-yes"]);
        run_bounded(&mut create, dir.path(), TOPOLOGY_DEADLINE);

        let cluster = TestCluster {
            ports,
            procs: Mutex::new(procs),
            killed_slots: Mutex::new(HashMap::new()),
            dir,
        };
        // every node agreeing on three replicas too: right after `create`, a
        // node may still see a replica as a primary without slots
        cluster.wait_healthy("the new cluster to come up", |view| {
            view.iter().filter(|n| n.role == Role::Replica).count() == NODES / 2
        });
        cluster
    }

    /// The temporary directory of the nodes' configs and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Every node, running or not, sorted by port.
    pub fn all_nodes(&self) -> Vec<Node> {
        self.ports.iter().map(|&port| Node { port }).collect()
    }

    /// `redis://127.0.0.1:PORT/` of every node (killed ones included: a
    /// cluster client skips those it cannot reach).
    pub fn seed_urls(&self) -> Vec<String> {
        self.all_nodes().iter().map(Node::url).collect()
    }

    /// A redis-rs cluster client over [`seed_urls`](Self::seed_urls),
    /// patient with a loaded machine (redis-rs's own default response
    /// timeout is 500 ms).
    pub fn client(&self) -> redis::cluster::ClusterClient {
        redis::cluster::ClusterClient::builder(self.seed_urls())
            .connection_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(5))
            .build()
            .expect("a cluster client")
    }

    /// A plain connection to one node (for assertions: `DBSIZE`, `INFO`, ...).
    pub fn connection(&self, node: Node) -> redis::Connection {
        connect(&node.url()).unwrap_or_else(|e| panic!("connect to cluster node {node:?}: {e}"))
    }

    pub fn is_running(&self, node: Node) -> bool {
        self.procs.lock().unwrap()[self.index(node)].is_running()
    }

    /// The nodes as the first running node that answers sees them, sorted
    /// by port (after the fixture's waits every node agrees).
    pub fn nodes(&self) -> Vec<NodeInfo> {
        let mut last = String::new();
        for node in self.all_nodes() {
            if !self.is_running(node) {
                continue;
            }
            match self.view_of(node) {
                Ok(view) => return view,
                Err(e) => last = e,
            }
        }
        panic!("no running cluster node answered CLUSTER NODES: {last}");
    }

    /// Primaries serving slots, sorted by port.
    pub fn primaries(&self) -> Vec<Node> {
        self.nodes()
            .into_iter()
            .filter(|n| n.role == Role::Primary && !n.slots.is_empty() && !n.failing)
            .map(|n| n.node)
            .collect()
    }

    /// Replicas not flagged failing, sorted by port.
    pub fn replicas(&self) -> Vec<Node> {
        self.nodes()
            .into_iter()
            .filter(|n| n.role == Role::Replica && !n.failing)
            .map(|n| n.node)
            .collect()
    }

    /// The replicas of `primary`.
    pub fn replicas_of(&self, primary: Node) -> Vec<Node> {
        let nodes = self.nodes();
        let id = Self::id_in(&nodes, primary);
        nodes
            .into_iter()
            .filter(|n| n.primary_id.as_deref() == Some(id.as_str()))
            .map(|n| n.node)
            .collect()
    }

    /// The primary serving `slot`.
    pub fn primary_for_slot(&self, slot: u16) -> Node {
        self.nodes()
            .into_iter()
            .find(|n| n.role == Role::Primary && n.serves(slot))
            .map(|n| n.node)
            .unwrap_or_else(|| panic!("no primary serves slot {slot}"))
    }

    /// The primary holding `key`.
    pub fn primary_for_key(&self, key: impl AsRef<[u8]>) -> Node {
        self.primary_for_slot(key_slot(key))
    }

    /// The node id of `node`.
    pub fn id(&self, node: Node) -> String {
        Self::id_in(&self.nodes(), node)
    }

    /// Kills a node's process with SIGKILL, as in a crash. A primary's
    /// replica takes over after the node timeout (1 s) and an election: see
    /// [`wait_for_failover`](Self::wait_for_failover).
    pub fn kill(&self, node: Node) {
        let served = self
            .nodes()
            .into_iter()
            .find(|n| n.node == node)
            .map(|n| n.slots)
            .unwrap_or_default();
        self.killed_slots.lock().unwrap().insert(node.port, served);
        let i = self.index(node);
        self.procs.lock().unwrap()[i].kill();
    }

    /// Starts a killed node again on its port with its cluster config: it
    /// rejoins (a failed-over primary as a replica of its successor). Waits
    /// until the whole cluster is healthy again.
    pub fn restart(&self, node: Node) {
        let i = self.index(node);
        {
            let mut procs = self.procs.lock().unwrap();
            assert!(!procs[i].is_running(), "restart of {node:?}, which runs");
            procs[i] = RedisProcess::spawn(
                &node_args(node.port, self.dir()),
                &log_path(node.port, self.dir()),
            );
        }
        wait_for(
            &format!("restarted cluster node {node:?} to answer PING"),
            TOPOLOGY_DEADLINE,
            || pings(node.port).then_some(()),
            || self.procs.lock().unwrap()[i].log_tail(30),
        );
        self.killed_slots.lock().unwrap().remove(&node.port);
        self.wait_healthy(&format!("the cluster to take back {node:?}"), |_| true);
    }

    /// Waits until a replica of the killed primary `old` serves its slots
    /// and every running node reports `cluster_state:ok` and agrees on the
    /// slots again; returns the new primary.
    pub fn wait_for_failover(&self, old: Node) -> Node {
        let old_slots = self
            .killed_slots
            .lock()
            .unwrap()
            .get(&old.port)
            .cloned()
            .unwrap_or_else(|| {
                self.nodes()
                    .into_iter()
                    .find(|n| n.node == old)
                    .map(|n| n.slots)
                    .unwrap_or_default()
            });
        let first = old_slots
            .first()
            .map(|r| *r.start())
            .unwrap_or_else(|| panic!("{old:?} served no slots: it was no primary"));
        let view = self.wait_healthy(&format!("a replica to take over from {old:?}"), |view| {
            view.iter()
                .any(|n| n.node != old && n.running && n.role == Role::Primary && n.serves(first))
        });
        view.into_iter()
            .find(|n| n.role == Role::Primary && n.serves(first))
            .map(|n| n.node)
            .expect("the new primary")
    }

    /// Moves `slot` from primary `from` to primary `to` live, step by step
    /// as `redis-cli --cluster reshard` does: IMPORTING on `to`, MIGRATING
    /// on `from`, MIGRATE of its keys in batches of 100, then SETSLOT NODE
    /// on `to`, `from` and the other primaries; waits until every running
    /// node sees `to` serve it. Clients meanwhile get ASK and MOVED.
    pub fn migrate_slot(&self, slot: u16, from: Node, to: Node) {
        self.begin_slot_migration(slot, from, to);
        let deadline = Instant::now() + TOPOLOGY_DEADLINE;
        while self.migrate_keys(slot, from, to, 100) > 0 {
            assert!(
                Instant::now() < deadline,
                "keys of slot {slot} still on {from:?} after {TOPOLOGY_DEADLINE:?}"
            );
        }
        self.finish_slot_migration(slot, from, to);
    }

    /// First step of [`migrate_slot`](Self::migrate_slot): `to` imports,
    /// `from` migrates `slot`.
    pub fn begin_slot_migration(&self, slot: u16, from: Node, to: Node) {
        let nodes = self.nodes();
        assert!(
            nodes.iter().any(|n| n.node == from && n.serves(slot)),
            "{from:?} does not serve slot {slot}"
        );
        let from_id = Self::id_in(&nodes, from);
        let to_id = Self::id_in(&nodes, to);
        self.setslot(to, slot, &["IMPORTING", &from_id]);
        self.setslot(from, slot, &["MIGRATING", &to_id]);
    }

    /// Moves up to `batch` keys of `slot` from `from` to `to` (one MIGRATE);
    /// returns how many it moved (0: none left).
    pub fn migrate_keys(&self, slot: u16, from: Node, to: Node, batch: usize) -> usize {
        let mut conn = self.connection(from);
        let keys: Vec<Vec<u8>> = redis::cmd("CLUSTER")
            .arg("GETKEYSINSLOT")
            .arg(slot)
            .arg(batch)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("CLUSTER GETKEYSINSLOT {slot} on {from:?}: {e}"));
        if keys.is_empty() {
            return 0;
        }
        let mut migrate = redis::cmd("MIGRATE");
        migrate
            .arg("127.0.0.1")
            .arg(to.port)
            .arg("")
            .arg(0)
            .arg(5000)
            .arg("KEYS");
        for key in &keys {
            migrate.arg(key);
        }
        let reply: String = migrate
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("MIGRATE of slot {slot} from {from:?} to {to:?}: {e}"));
        assert!(
            reply == "OK" || reply == "NOKEY",
            "MIGRATE answered {reply}"
        );
        keys.len()
    }

    /// Last step of [`migrate_slot`](Self::migrate_slot): `slot` belongs to
    /// `to` (told to `to`, then `from`, then the other primaries); waits
    /// until every running node agrees.
    pub fn finish_slot_migration(&self, slot: u16, from: Node, to: Node) {
        let to_id = self.id(to);
        self.setslot(to, slot, &["NODE", &to_id]);
        self.setslot(from, slot, &["NODE", &to_id]);
        for other in self.primaries() {
            if other != to && other != from {
                self.setslot(other, slot, &["NODE", &to_id]);
            }
        }
        self.wait_healthy(
            &format!("every node to see {to:?} serve slot {slot}"),
            |view| view.iter().any(|n| n.node == to && n.serves(slot)),
        );
    }

    fn setslot(&self, node: Node, slot: u16, args: &[&str]) {
        let mut conn = self.connection(node);
        let _: () = redis::cmd("CLUSTER")
            .arg("SETSLOT")
            .arg(slot)
            .arg(args)
            .query(&mut conn)
            .unwrap_or_else(|e| panic!("CLUSTER SETSLOT {slot} {args:?} on {node:?}: {e}"));
    }

    fn index(&self, node: Node) -> usize {
        self.ports
            .iter()
            .position(|&p| p == node.port)
            .unwrap_or_else(|| panic!("{node:?} is not a node of this cluster"))
    }

    fn id_in(nodes: &[NodeInfo], node: Node) -> String {
        nodes
            .iter()
            .find(|n| n.node == node)
            .map(|n| n.id.clone())
            .unwrap_or_else(|| panic!("{node:?} is unknown to the cluster"))
    }

    /// `CLUSTER NODES` as `node` sees it, with `running` filled in.
    fn view_of(&self, node: Node) -> Result<Vec<NodeInfo>, String> {
        let mut conn = connect(&node.url()).map_err(|e| format!("{node:?}: {e}"))?;
        let text: String = redis::cmd("CLUSTER")
            .arg("NODES")
            .query(&mut conn)
            .map_err(|e| format!("{node:?}: CLUSTER NODES: {e}"))?;
        let procs = self.procs.lock().unwrap();
        let mut view = parse_nodes(&text);
        for n in &mut view {
            n.running = self
                .ports
                .iter()
                .position(|&p| p == n.node.port)
                .is_some_and(|i| procs[i].is_running());
        }
        view.sort_by_key(|n| n.node);
        Ok(view)
    }

    /// Whether the cluster is healthy from every running node's view, and
    /// `also` holds of the agreed view: `Ok(view)` or why not.
    fn health(&self, also: &dyn Fn(&[NodeInfo]) -> bool) -> Result<Vec<NodeInfo>, String> {
        let mut agreed: Option<(Node, Vec<NodeInfo>, BTreeMap<u16, u16>)> = None;
        for node in self.all_nodes() {
            if !self.is_running(node) {
                continue;
            }
            let mut conn = connect(&node.url()).map_err(|e| format!("{node:?}: {e}"))?;
            let info: String = redis::cmd("CLUSTER")
                .arg("INFO")
                .query(&mut conn)
                .map_err(|e| format!("{node:?}: CLUSTER INFO: {e}"))?;
            let info = fields(&info);
            for (name, want) in [
                ("cluster_state", "ok"),
                ("cluster_slots_assigned", "16384"),
                ("cluster_slots_ok", "16384"),
                ("cluster_known_nodes", "6"),
            ] {
                let got = field(&info, name).unwrap_or("?");
                if got != want {
                    return Err(format!("{node:?} reports {name}:{got}"));
                }
            }
            let view = self.view_of(node)?;
            let me = view
                .iter()
                .find(|n| n.node == node)
                .ok_or_else(|| format!("{node:?} does not list itself"))?;
            if me.role == Role::Replica {
                let repl = super::process::info(&mut conn, "replication")
                    .map_err(|e| format!("{node:?}: INFO replication: {e}"))?;
                let link = field(&repl, "master_link_status").unwrap_or("?");
                if link != "up" {
                    return Err(format!("replica {node:?} has master_link_status:{link}"));
                }
            }
            if let Some(bad) = view.iter().find(|n| n.running && n.failing) {
                return Err(format!("{node:?} flags running {:?} as failing", bad.node));
            }
            // (a primary that comes back after its failover reports itself a
            // primary without slots until it learns it was replaced)
            if let Some(bad) = view
                .iter()
                .find(|n| n.running && n.role == Role::Primary && n.slots.is_empty())
            {
                return Err(format!(
                    "{node:?} sees {:?} as a primary without slots",
                    bad.node
                ));
            }
            if let Some(bad) = view.iter().find(|n| !n.slots.is_empty() && !n.running) {
                return Err(format!("{node:?} sees killed {:?} serve slots", bad.node));
            }
            if let Some(bad) = view
                .iter()
                .find(|n| n.running && n.role == Role::Replica && n.primary_id.is_none())
            {
                return Err(format!(
                    "{node:?} sees replica {:?} without a primary",
                    bad.node
                ));
            }
            let owners: BTreeMap<u16, u16> = view
                .iter()
                .flat_map(|n| n.slots.iter().map(move |r| (*r.start(), n.node.port)))
                .collect();
            match &agreed {
                None => agreed = Some((node, view, owners)),
                Some((first, _, theirs)) if *theirs != owners => {
                    return Err(format!("{node:?} and {first:?} disagree on the slots"));
                }
                Some(_) => {}
            }
        }
        let (_, view, _) = agreed.ok_or("no node runs")?;
        if !also(&view) {
            return Err("the awaited change has not happened yet".into());
        }
        Ok(view)
    }

    /// Waits (bounded) until [`health`](Self::health) holds with `also`.
    fn wait_healthy(&self, what: &str, also: impl Fn(&[NodeInfo]) -> bool) -> Vec<NodeInfo> {
        let last = RefCell::new(String::new());
        wait_for(
            &format!("waiting for {what}"),
            TOPOLOGY_DEADLINE,
            || match self.health(&also) {
                Ok(view) => Some(view),
                Err(why) => {
                    *last.borrow_mut() = why;
                    None
                }
            },
            || {
                let mut explain = format!("last: {}\n", last.borrow());
                for port in &self.ports {
                    explain.push_str(&super::process::log_tail(&log_path(*port, self.dir()), 8));
                    explain.push('\n');
                }
                explain
            },
        )
    }
}

/// The cluster shared by the tests of one binary that neither kill nor move
/// anything (started on first use, stopped when the process exits).
pub fn shared() -> &'static TestCluster {
    static SHARED: std::sync::OnceLock<TestCluster> = std::sync::OnceLock::new();
    SHARED.get_or_init(TestCluster::start)
}
