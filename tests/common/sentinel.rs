//! `TestSentinel`: a master, one replica and three sentinels on 127.0.0.1,
//! started by the test, with a master to kill and a failover to wait for.
//!
//! Every method blocks (bounded); from async code call `wait_for_new_master`
//! through `tokio::task::spawn_blocking` with the fixture in an `Arc`.

use std::cell::RefCell;
use std::path::Path;
use std::sync::Mutex;

use super::process::{
    connect, field, free_port, info, log_tail, wait_for, RedisProcess, TOPOLOGY_DEADLINE,
};

/// The name the sentinels monitor the master under.
pub const MASTER_NAME: &str = "topology";

/// A master and a replica (`--replicaof`) monitored by three sentinels
/// (quorum 2, down after 500 ms, failover timeout 2 s), in a temporary
/// directory removed on drop.
pub struct TestSentinel {
    /// First, so the sentinels stop before the data nodes (no failover
    /// while the fixture is dropped).
    sentinel_ports: Vec<u16>,
    sentinels: Mutex<Vec<RedisProcess>>,
    /// The data nodes: the first master, then its replica.
    data_ports: Vec<u16>,
    data: Mutex<Vec<RedisProcess>>,
    /// Last, so it is removed after the processes have stopped.
    dir: tempfile::TempDir,
}

fn data_args(port: u16, dir: &Path) -> String {
    let dir = dir.display();
    format!(
        "--port {port} --bind 127.0.0.1 --save '' --appendonly no --dir '{dir}' \
         --dbfilename 'dump-{port}.rdb' --repl-diskless-sync-delay 0 --loglevel notice"
    )
}

fn data_log(port: u16, dir: &Path) -> std::path::PathBuf {
    dir.join(format!("data-{port}.log"))
}

fn sentinel_log(port: u16, dir: &Path) -> std::path::PathBuf {
    dir.join(format!("sentinel-{port}.log"))
}

/// `SENTINEL <sub> NAME` replies that are flat `key value ...` arrays.
fn pairs(flat: Vec<String>) -> Vec<(String, String)> {
    flat.chunks(2)
        .filter(|kv| kv.len() == 2)
        .map(|kv| (kv[0].clone(), kv[1].clone()))
        .collect()
}

impl TestSentinel {
    /// Starts the master and its replica, waits until the replica is in
    /// sync, then starts three sentinels and waits until each knows the
    /// master, the replica and the two other sentinels. Panics (with the
    /// logs) when that takes longer than [`TOPOLOGY_DEADLINE`].
    pub fn start() -> TestSentinel {
        let dir = tempfile::Builder::new()
            .prefix("redis-sentinel-")
            .tempdir()
            .expect("create a temporary directory for the sentinels");
        let master = free_port();
        let replica = free_port();
        let data = vec![
            RedisProcess::spawn(
                &data_args(master, dir.path()),
                &data_log(master, dir.path()),
            ),
            RedisProcess::spawn(
                &format!(
                    "{} --replicaof 127.0.0.1 {master}",
                    data_args(replica, dir.path())
                ),
                &data_log(replica, dir.path()),
            ),
        ];
        let sentinel_ports: Vec<u16> = (0..3).map(|_| free_port()).collect();
        let fixture = TestSentinel {
            sentinel_ports,
            sentinels: Mutex::new(Vec::new()),
            data_ports: vec![master, replica],
            data: Mutex::new(data),
            dir,
        };
        // The replica in sync before the sentinels start: their first INFO
        // of the master then lists it (later ones come every 10 s).
        fixture.wait_until("the replica to sync with the master", || {
            let mut conn = connect(&url(replica)).map_err(|e| e.to_string())?;
            let repl = info(&mut conn, "replication").map_err(|e| e.to_string())?;
            match field(&repl, "master_link_status") {
                Some("up") => Ok(()),
                other => Err(format!("replica master_link_status: {other:?}")),
            }
        });
        {
            let mut sentinels = fixture.sentinels.lock().unwrap();
            for &port in &fixture.sentinel_ports {
                let conf = fixture.dir().join(format!("sentinel-{port}.conf"));
                std::fs::write(
                    &conf,
                    format!(
                        "port {port}\nbind 127.0.0.1\ndir \"{dir}\"\n\
                         sentinel resolve-hostnames no\n\
                         sentinel monitor {MASTER_NAME} 127.0.0.1 {master} 2\n\
                         sentinel down-after-milliseconds {MASTER_NAME} 500\n\
                         sentinel failover-timeout {MASTER_NAME} 2000\n\
                         sentinel parallel-syncs {MASTER_NAME} 1\n",
                        dir = fixture.dir().display()
                    ),
                )
                .expect("write a sentinel config");
                sentinels.push(RedisProcess::spawn(
                    &format!("'{}' --sentinel", conf.display()),
                    &sentinel_log(port, fixture.dir()),
                ));
            }
        }
        fixture.wait_until(
            "the sentinels to know the master, its replica and each other",
            || {
                for &port in &fixture.sentinel_ports {
                    let master = fixture.sentinel_master(port)?;
                    for (name, want) in [
                        ("flags", "master"),
                        ("num-slaves", "1"),
                        ("num-other-sentinels", "2"),
                    ] {
                        let got = field(&master, name).unwrap_or("?");
                        if got != want {
                            return Err(format!("sentinel {port} reports {name} {got}"));
                        }
                    }
                }
                Ok(())
            },
        );
        fixture
    }

    /// `redis://127.0.0.1:PORT/` of each sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinel_ports.iter().map(|&p| url(p)).collect()
    }

    /// The name the master is monitored under.
    pub fn master_name(&self) -> &str {
        MASTER_NAME
    }

    /// The ports of the two data nodes (the first master, then its replica).
    pub fn data_ports(&self) -> &[u16] {
        &self.data_ports
    }

    /// The temporary directory of the configs and logs.
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// The master's address as the first sentinel that answers reports it
    /// (`SENTINEL get-master-addr-by-name`): `("127.0.0.1", port)`.
    pub fn master_addr(&self) -> (String, u16) {
        let mut last = String::new();
        for &port in &self.sentinel_ports {
            match self.reported_master(port) {
                Ok(addr) => return addr,
                Err(e) => last = e,
            }
        }
        panic!("no sentinel reported the master: {last}");
    }

    /// `redis://` URL of the master the sentinels report.
    pub fn master_url(&self) -> String {
        url(self.master_addr().1)
    }

    /// A plain connection to a data node.
    pub fn connection(&self, port: u16) -> redis::Connection {
        connect(&url(port)).unwrap_or_else(|e| panic!("connect to data node {port}: {e}"))
    }

    /// Kills (SIGKILL) the data node the sentinels report as master;
    /// returns its port.
    pub fn kill_master(&self) -> u16 {
        let (_, port) = self.master_addr();
        let i = self.data_index(port);
        self.data.lock().unwrap()[i].kill();
        port
    }

    /// Starts a killed data node again (as a master with no data; the
    /// sentinels turn it into a replica of the current master in time).
    /// Waits until it answers PING.
    pub fn restart(&self, port: u16) {
        let i = self.data_index(port);
        {
            let mut data = self.data.lock().unwrap();
            assert!(
                !data[i].is_running(),
                "restart of data node {port}, which runs"
            );
            data[i] =
                RedisProcess::spawn(&data_args(port, self.dir()), &data_log(port, self.dir()));
        }
        self.wait_until(
            &format!("restarted data node {port} to answer PING"),
            || {
                let mut conn = connect(&url(port)).map_err(|e| e.to_string())?;
                redis::cmd("PING")
                    .query::<String>(&mut conn)
                    .map(drop)
                    .map_err(|e| e.to_string())
            },
        );
    }

    /// Waits until every running sentinel reports the same master, other
    /// than `old`, and that node says it is a master; returns its port.
    pub fn wait_for_new_master(&self, old: u16) -> u16 {
        self.wait_until(
            &format!("the sentinels to promote a master other than {old}"),
            || {
                let mut agreed = None;
                for (i, &port) in self.sentinel_ports.iter().enumerate() {
                    if !self.sentinels.lock().unwrap()[i].is_running() {
                        continue;
                    }
                    let (_, master) = self.reported_master(port)?;
                    if master == old {
                        return Err(format!("sentinel {port} still reports {old}"));
                    }
                    match agreed {
                        Some(other) if other != master => {
                            return Err(format!("sentinels report {other} and {master}"));
                        }
                        _ => agreed = Some(master),
                    }
                }
                let master = agreed.ok_or("no sentinel runs")?;
                let mut conn = connect(&url(master)).map_err(|e| e.to_string())?;
                let repl = info(&mut conn, "replication").map_err(|e| e.to_string())?;
                match field(&repl, "role") {
                    Some("master") => Ok(master),
                    other => Err(format!("{master} has role {other:?}")),
                }
            },
        )
    }

    fn reported_master(&self, sentinel: u16) -> Result<(String, u16), String> {
        let mut conn = connect(&url(sentinel)).map_err(|e| format!("sentinel {sentinel}: {e}"))?;
        let addr: Option<(String, u16)> = redis::cmd("SENTINEL")
            .arg("get-master-addr-by-name")
            .arg(MASTER_NAME)
            .query(&mut conn)
            .map_err(|e| format!("sentinel {sentinel}: get-master-addr-by-name: {e}"))?;
        addr.ok_or_else(|| format!("sentinel {sentinel} knows no master {MASTER_NAME}"))
    }

    fn sentinel_master(&self, sentinel: u16) -> Result<Vec<(String, String)>, String> {
        let mut conn = connect(&url(sentinel)).map_err(|e| format!("sentinel {sentinel}: {e}"))?;
        let flat: Vec<String> = redis::cmd("SENTINEL")
            .arg("MASTER")
            .arg(MASTER_NAME)
            .query(&mut conn)
            .map_err(|e| format!("sentinel {sentinel}: SENTINEL MASTER: {e}"))?;
        Ok(pairs(flat))
    }

    fn data_index(&self, port: u16) -> usize {
        self.data_ports
            .iter()
            .position(|&p| p == port)
            .unwrap_or_else(|| panic!("{port} is no data node of this fixture"))
    }

    fn wait_until<T>(&self, what: &str, mut probe: impl FnMut() -> Result<T, String>) -> T {
        let last = RefCell::new(String::new());
        wait_for(
            &format!("waiting for {what}"),
            TOPOLOGY_DEADLINE,
            || match probe() {
                Ok(v) => Some(v),
                Err(why) => {
                    *last.borrow_mut() = why;
                    None
                }
            },
            || {
                let mut explain = format!("last: {}\n", last.borrow());
                for &p in &self.data_ports {
                    explain.push_str(&log_tail(&data_log(p, self.dir()), 8));
                    explain.push('\n');
                }
                for &p in &self.sentinel_ports {
                    explain.push_str(&log_tail(&sentinel_log(p, self.dir()), 12));
                    explain.push('\n');
                }
                explain
            },
        )
    }
}

fn url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}/")
}
