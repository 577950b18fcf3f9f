//! Sessions stepped in a fixed order, the way PostgreSQL's isolation tester steps them: each
//! session is a connection of its own, driven from its own thread; a step is sent to one session
//! and the test waits until it has either finished or is waiting for a lock (then it is reported
//! blocked, and a later step of another session may release it). Races are written as the exact
//! interleaving they need, never as sleeps.
//!
//! ```ignore
//! let mut a = Session::open(&cluster, "postgres", "a");
//! let mut b = Session::open(&cluster, "postgres", "b");
//! a.run("BEGIN");
//! a.run("SELECT outbox_enqueue('t', '1', 'e', '{}')");
//! b.run("BEGIN");
//! assert!(b.step("SELECT outbox_enqueue('t', '1', 'e', '{}')").is_blocked());
//! a.run("COMMIT");
//! b.finish().unwrap();
//! ```

use std::sync::mpsc::{channel, Receiver, RecvTimeoutError, Sender};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{Cluster, DEADLINE};

/// The text rows a statement returned (NULL as `None`), or its error.
pub type Rows = Vec<Vec<Option<String>>>;

/// An error a step raised: its SQLSTATE, message, detail and hint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepError {
    pub code: String,
    pub message: String,
    pub detail: Option<String>,
    pub hint: Option<String>,
}

/// What a step did by the time the test looked.
#[derive(Debug)]
pub enum Step {
    Done(Result<Rows, StepError>),
    /// Waiting for a lock (the session's backend waits in the lock manager).
    Blocked,
}

impl Step {
    pub fn is_blocked(&self) -> bool {
        matches!(self, Step::Blocked)
    }
}

/// One session of a stepped interleaving.
pub struct Session {
    pub name: String,
    /// Its backend's process id.
    pub pid: i32,
    port: u16,
    database: String,
    commands: Option<Sender<String>>,
    results: Receiver<Result<Rows, StepError>>,
    worker: Option<JoinHandle<()>>,
    /// A step that was blocked and has not been finished yet.
    pending: Option<String>,
}

fn error_of(error: postgres::Error) -> StepError {
    match error.as_db_error() {
        Some(db) => StepError {
            code: db.code().code().to_string(),
            message: db.message().to_string(),
            detail: db.detail().map(str::to_string),
            hint: db.hint().map(str::to_string),
        },
        None => StepError { code: String::new(), message: error.to_string(), detail: None, hint: None },
    }
}

fn text_rows(messages: Vec<postgres::SimpleQueryMessage>) -> Rows {
    messages
        .into_iter()
        .filter_map(|message| match message {
            postgres::SimpleQueryMessage::Row(row) => {
                Some((0..row.len()).map(|n| row.get(n).map(str::to_string)).collect())
            }
            _ => None,
        })
        .collect()
}

impl Session {
    /// Opens a session on `database` of `cluster`, as the superuser `postgres`.
    pub fn open(cluster: &Cluster, database: &str, name: &str) -> Session {
        Session::open_as(cluster, database, "postgres", name)
    }

    /// Opens a session on `database` of `cluster` as role `user` (which can log in).
    pub fn open_as(cluster: &Cluster, database: &str, user: &str, name: &str) -> Session {
        let mut client = postgres::Client::connect(
            &format!("host=127.0.0.1 port={} user={user} dbname={database} connect_timeout=10", cluster.port),
            postgres::NoTls,
        )
        .unwrap_or_else(|e| panic!("session {name}: connect to {database} as {user}: {e}"));
        let pid: i32 = client.query_one("SELECT pg_backend_pid()", &[]).unwrap().get(0);
        let (commands, inbox) = channel::<String>();
        let (outbox, results) = channel();
        let worker = std::thread::spawn(move || {
            for sql in inbox {
                let result = client.simple_query(&sql).map(text_rows).map_err(error_of);
                if outbox.send(result).is_err() {
                    break;
                }
            }
        });
        Session {
            name: name.to_string(),
            pid,
            port: cluster.port,
            database: database.to_string(),
            commands: Some(commands),
            results,
            worker: Some(worker),
            pending: None,
        }
    }

    /// Whether this session's backend is waiting for a lock right now.
    fn waits_for_lock(&self, observer: &mut postgres::Client) -> bool {
        observer
            .query_one(
                "SELECT coalesce(wait_event_type = 'Lock', false) FROM pg_stat_activity WHERE pid = $1",
                &[&self.pid],
            )
            .map(|row| row.get::<_, bool>(0))
            .unwrap_or(false)
    }

    /// Sends `sql` and waits until it finished or blocked on a lock.
    pub fn step(&mut self, sql: &str) -> Step {
        assert!(self.pending.is_none(), "session {}: a blocked step is still pending: {:?}", self.name, self.pending);
        self.commands.as_ref().unwrap().send(sql.to_string()).unwrap();
        let mut observer = postgres::Client::connect(
            &format!("host=127.0.0.1 port={} user=postgres dbname={} connect_timeout=10", self.port, self.database),
            postgres::NoTls,
        )
        .unwrap();
        let deadline = Instant::now() + DEADLINE;
        loop {
            match self.results.recv_timeout(Duration::from_millis(5)) {
                Ok(result) => return Step::Done(result),
                Err(RecvTimeoutError::Disconnected) => panic!("session {}: its connection thread ended", self.name),
                Err(RecvTimeoutError::Timeout) => {}
            }
            if self.waits_for_lock(&mut observer) {
                self.pending = Some(sql.to_string());
                return Step::Blocked;
            }
            assert!(
                Instant::now() < deadline,
                "session {}: `{sql}` neither finished nor blocked within {DEADLINE:?}",
                self.name
            );
        }
    }

    /// Runs `sql`, which must finish without blocking, and returns its rows; panics on an error.
    pub fn run(&mut self, sql: &str) -> Rows {
        match self.step(sql) {
            Step::Done(Ok(rows)) => rows,
            Step::Done(Err(error)) => panic!("session {}: `{sql}` failed: {error:?}", self.name),
            Step::Blocked => panic!("session {}: `{sql}` blocked on a lock", self.name),
        }
    }

    /// Runs `sql` and returns its one value (first column of the first row).
    pub fn value(&mut self, sql: &str) -> Option<String> {
        self.run(sql).into_iter().next().and_then(|row| row.into_iter().next()).flatten()
    }

    /// Runs `sql`, which must fail without blocking, and returns the error.
    pub fn fails(&mut self, sql: &str) -> StepError {
        match self.step(sql) {
            Step::Done(Err(error)) => error,
            Step::Done(Ok(rows)) => panic!("session {}: `{sql}` succeeded ({rows:?}), expected an error", self.name),
            Step::Blocked => panic!("session {}: `{sql}` blocked on a lock", self.name),
        }
    }

    /// Sends `sql`, which must block on a lock.
    pub fn blocks(&mut self, sql: &str) {
        match self.step(sql) {
            Step::Blocked => {}
            Step::Done(result) => panic!("session {}: `{sql}` did not block: {result:?}", self.name),
        }
    }

    /// Waits (with the deadline) for the blocked step to finish, and returns what it returned.
    pub fn finish(&mut self) -> Result<Rows, StepError> {
        let sql = self.pending.take().unwrap_or_else(|| panic!("session {}: no blocked step to finish", self.name));
        match self.results.recv_timeout(DEADLINE) {
            Ok(result) => result,
            Err(_) => panic!("session {}: blocked step `{sql}` did not finish within {DEADLINE:?}", self.name),
        }
    }

    /// Whether the blocked step is still waiting (true) or has finished meanwhile (false; its result
    /// is then returned by `finish`).
    pub fn still_blocked(&mut self) -> bool {
        assert!(self.pending.is_some(), "session {}: no blocked step", self.name);
        let mut observer = postgres::Client::connect(
            &format!("host=127.0.0.1 port={} user=postgres dbname={} connect_timeout=10", self.port, self.database),
            postgres::NoTls,
        )
        .unwrap();
        self.waits_for_lock(&mut observer)
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        // Closing the channel ends the thread once its statement (if any) returns; a session still
        // blocked is left to end with the cluster.
        self.commands.take();
        if self.pending.is_none() {
            if let Some(worker) = self.worker.take() {
                let _ = worker.join();
            }
        }
    }
}
