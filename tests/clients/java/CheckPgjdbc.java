// The fencing scenarios through pgjdbc (the PostgreSQL JDBC driver), against
// FENCEGATE_CLIENT_DSN (a libpq URL, turned into a JDBC one here).
//
//   java -cp /usr/share/java/postgresql.jar CheckPgjdbc.java
//
// Starts from the state tests/clients/fixture.sh leaves (sweep_state row 1 'initial',
// resource `sweeper` with no token yet) and moves `sweeper` through terms 42 and 43,
// so it runs once per fresh fixture. Prints one line per check and `ok <n> checks`,
// or `FAIL <scenario>: <what differed>` and exits 1. See ../README.md.
//
// pgjdbc speaks only the extended protocol by default: Statement.execute of several
// statements sends one Parse/Bind/Execute each and a single Sync after the last.

import java.io.StringReader;
import java.io.StringWriter;
import java.net.URI;
import java.net.URLDecoder;
import java.nio.charset.StandardCharsets;
import java.security.MessageDigest;
import java.sql.*;
import java.util.*;
import java.util.concurrent.*;
import org.postgresql.PGConnection;
import org.postgresql.PGNotification;
import org.postgresql.util.PSQLException;
import org.postgresql.util.ServerErrorMessage;

public class CheckPgjdbc {
    static final long SCENARIO_TIMEOUT_S = 20;
    static final String UPDATE = "UPDATE sweep_state SET note = ? WHERE id = 1";
    // One statement that presents its own token: with the connection's token (42) the
    // trigger lets the INSERT start, and fence() then checks this row's token.
    static final String BATCH_INSERT = "INSERT INTO sweep_state (id, note) SELECT ?::int, ?::text"
            + " WHERE fencegate.fence('sweeper', ?::bigint) IS NOT NULL";
    static final String MULTI = "BEGIN; SELECT fencegate.fence('sweeper', 42);"
            + " UPDATE sweep_state SET note = 'multi-1' WHERE id = 1; COMMIT;"
            + " UPDATE sweep_state SET note = 'multi-2' WHERE id = 1";
    static final String STALE_DETAIL = "resource=sweeper presented=41 highest=42";
    static final String TOKEN_42 = "-c fencegate.token=42";

    static int checks = 0;

    static class Mismatch extends RuntimeException {
        Mismatch(String message) { super(message); }
    }

    interface Scenario { void run() throws Exception; }

    interface SqlAction { void run() throws SQLException; }

    static void check(String name, Object got, Object want) {
        if (!Objects.equals(got, want)) {
            throw new Mismatch(name + ": expected " + show(want) + ", got " + show(got));
        }
        checks++;
        System.out.println("ok " + name);
    }

    static String show(Object v) { return v instanceof String ? "'" + v + "'" : String.valueOf(v); }

    // FENCEGATE_CLIENT_DSN is postgres://user[:password]@host:port/db[?params]; its
    // params (sslmode, ...) are pgjdbc connection properties of the same names.
    static Connection connect(String options) throws SQLException {
        URI dsn = URI.create(System.getenv("FENCEGATE_CLIENT_DSN"));
        Properties props = new Properties();
        if (dsn.getRawQuery() != null) {
            for (String pair : dsn.getRawQuery().split("&")) {
                String[] kv = pair.split("=", 2);
                props.setProperty(decode(kv[0]), kv.length > 1 ? decode(kv[1]) : "");
            }
        }
        String[] user = dsn.getRawUserInfo().split(":", 2);
        props.setProperty("user", decode(user[0]));
        if (user.length > 1) props.setProperty("password", decode(user[1]));
        props.setProperty("connectTimeout", "10");
        if (options != null) props.setProperty("options", options);
        int port = dsn.getPort() == -1 ? 5432 : dsn.getPort();
        return DriverManager.getConnection(
                "jdbc:postgresql://" + dsn.getHost() + ":" + port + dsn.getRawPath(), props);
    }

    static Connection connect() throws SQLException { return connect(null); }

    static String decode(String s) { return URLDecoder.decode(s, StandardCharsets.UTF_8); }

    /** Runs action; returns the server's error it failed with (found along the cause chain), or null. */
    static PSQLException errorOf(SqlAction action) throws SQLException {
        try {
            action.run();
        } catch (SQLException e) {
            for (Throwable t = e; t != null; t = t instanceof SQLException s && s.getNextException() != null
                    ? s.getNextException() : t.getCause()) {
                if (t instanceof PSQLException p && p.getServerErrorMessage() != null) return p;
            }
            throw e;
        }
        return null;
    }

    static void checkError(String name, PSQLException err, String sqlstate, String detail) {
        check(name + ": SQLSTATE", err == null ? null : err.getSQLState(), sqlstate);
        if (detail != null) {
            ServerErrorMessage m = err.getServerErrorMessage();
            String[] parts = m.getDetail().split(" proof=", 2);
            check(name + ": DETAIL", parts[0], detail);
            check(name + ": DETAIL proof", parts.length == 2 && parts[1].matches("[0-9a-f]{64}"), true);
            check(name + ": HINT non-empty", m.getHint() != null && !m.getHint().isEmpty(), true);
        }
    }

    static void checkError(String name, PSQLException err, String sqlstate) { checkError(name, err, sqlstate, null); }

    static Object scalar(Connection c, String sql, Object... params) throws SQLException {
        try (PreparedStatement st = c.prepareStatement(sql)) {
            for (int i = 0; i < params.length; i++) st.setObject(i + 1, params[i]);
            try (ResultSet rs = st.executeQuery()) {
                rs.next();
                return rs.getObject(1);
            }
        }
    }

    static int update(Connection c, String sql, Object... params) throws SQLException {
        try (PreparedStatement st = c.prepareStatement(sql)) {
            for (int i = 0; i < params.length; i++) st.setObject(i + 1, params[i]);
            return st.executeUpdate();
        }
    }

    static Object note(Connection c) throws SQLException {
        return scalar(c, "SELECT note FROM sweep_state WHERE id = 1");
    }

    static void seed() throws Exception {
        try (Connection b = connect(); Connection a = connect()) {
            b.setAutoCommit(false); // node-b, term 42, literal SQL
            try (Statement st = b.createStatement()) {
                st.execute("SELECT fencegate.fence('sweeper', 42)");
                st.executeUpdate("UPDATE sweep_state SET note = 'node-b' WHERE id = 1");
            }
            b.commit();
            a.setAutoCommit(false); // the delayed term-41 transaction, bind parameters
            PSQLException err = errorOf(() -> {
                scalar(a, "SELECT fencegate.fence(?, ?)", "sweeper", 41L);
                update(a, UPDATE, "node-a");
            });
            a.rollback();
            checkError("seed: node-a (41) after node-b (42)", err, "ZF001", STALE_DETAIL);
            check("seed: row still reads node-b", note(a), "node-b");
        }
    }

    static void startupOptions() throws Exception {
        try (Connection c = connect(TOKEN_42)) {
            check("options 42: UPDATE outside a transaction", update(c, UPDATE, "options-42"), 1);
        }
        try (Connection c = connect("-c fencegate.token=41")) {
            checkError("options 41: UPDATE", errorOf(() -> update(c, UPDATE, "options-41")), "ZF001", STALE_DETAIL);
            check("options 41: row reads options-42", note(c), "options-42");
        }
    }

    static void noToken() throws Exception {
        try (Connection c = connect()) {
            checkError("no token: UPDATE", errorOf(() -> update(c, UPDATE, "no-token")), "ZF002");
        }
    }

    static void abortedTransaction() throws Exception {
        try (Connection c = connect()) {
            c.setAutoCommit(false);
            checkError("aborted tx: stale fence()",
                    errorOf(() -> scalar(c, "SELECT fencegate.fence(?, ?)", "sweeper", 41L)), "ZF001");
            checkError("aborted tx: next statement", errorOf(() -> scalar(c, "SELECT 1")), "25P02");
            c.rollback();
            check("aborted tx: usable after ROLLBACK", scalar(c, "SELECT 1"), 1);
        }
    }

    static void batch() throws Exception {
        try (Connection c = connect(TOKEN_42); PreparedStatement st = c.prepareStatement(BATCH_INSERT)) {
            // Autocommit: pgjdbc sends the whole batch before one Sync, one implicit transaction.
            for (Object[] row : new Object[][] {{10, "batch", 42L}, {11, "batch", 41L}, {12, "batch", 42L}}) {
                for (int i = 0; i < row.length; i++) st.setObject(i + 1, row[i]);
                st.addBatch();
            }
            checkError("executeBatch: stale second row", errorOf(st::executeBatch), "ZF001", STALE_DETAIL);
            check("executeBatch: nothing landed", scalar(c, "SELECT count(*) FROM sweep_state WHERE id >= 10"), 0L);
        }
    }

    static void multiStatement() throws Exception {
        try (Connection c = connect(); Statement st = c.createStatement()) {
            checkError("multi-statement: UPDATE after COMMIT", errorOf(() -> st.execute(MULTI)), "ZF002");
            check("multi-statement: part before COMMIT committed", note(c), "multi-1");
        }
    }

    static void copy() throws Exception {
        try (Connection c = connect()) {
            var copyApi = c.unwrap(PGConnection.class).getCopyAPI();
            String copyIn = "COPY sweep_state (id, note) FROM STDIN";
            c.setAutoCommit(false);
            check("copy: fence term 43", scalar(c, "SELECT fencegate.fence(?, ?)", "sweeper", 43L), 43L);
            copyApi.copyIn(copyIn, new StringReader("20\tcopy-20\n21\tcopy-21\n"));
            c.commit();
            c.setAutoCommit(true);
            checkError("copy: COPY FROM without a token",
                    errorOf(() -> copyIn(copyApi, copyIn, "22\tcopy-22\n")), "ZF002");
            StringWriter out = new StringWriter();
            copyApi.copyOut("COPY (SELECT id, note FROM sweep_state WHERE id >= 20 ORDER BY id) TO STDOUT", out);
            check("copy: COPY TO reads the rows", out.toString(), "20\tcopy-20\n21\tcopy-21\n");
        }
    }

    static void copyIn(org.postgresql.copy.CopyManager api, String sql, String text) throws SQLException {
        try {
            api.copyIn(sql, new StringReader(text));
        } catch (java.io.IOException e) {
            throw new SQLException(e);
        }
    }

    static void cancel() throws Exception {
        ExecutorService pool = Executors.newSingleThreadExecutor(daemon());
        try (Connection victim = connect(); Connection bystander = connect();
             Statement st = victim.createStatement()) {
            Future<Object> beside = pool.submit(() -> scalar(bystander, "SELECT 'unaffected' FROM pg_sleep(1.5)"));
            // pgjdbc's query timeout is a timer that calls Statement.cancel(): a
            // CancelRequest on a new connection, with the victim's key.
            st.setQueryTimeout(1);
            long start = System.nanoTime();
            PSQLException err = errorOf(() -> st.execute("SELECT pg_sleep(10)"));
            double elapsed = (System.nanoTime() - start) / 1e9;
            checkError("cancel: pg_sleep(10) with setQueryTimeout(1)", err, "57014");
            check("cancel: within 2 s", elapsed < 2, true);
            check("cancel: concurrent query on another connection", beside.get(5, TimeUnit.SECONDS), "unaffected");
            check("cancel: connection usable", scalar(victim, "SELECT 1"), 1);
        } finally {
            pool.shutdownNow();
        }
    }

    static void listenNotify() throws Exception {
        try (Connection listener = connect(); Connection sender = connect();
             Statement ls = listener.createStatement(); Statement ss = sender.createStatement()) {
            ls.execute("LISTEN fencegate_clients");
            ss.execute("SELECT pg_notify('fencegate_clients', 'from-sender')");
            PGNotification[] got = listener.unwrap(PGConnection.class).getNotifications(5000);
            check("notify: delivered to the idle listener",
                    got == null ? null : Arrays.stream(got).map(n -> n.getName() + " " + n.getParameter()).toList(),
                    List.of("fencegate_clients from-sender"));
        }
    }

    static void bytea() throws Exception {
        byte[] blob = new byte[16 * 1024 * 1024]; // 16 MiB, every byte value
        for (int i = 0; i < blob.length; i++) blob[i] = (byte) i;
        try (Connection c = connect(); PreparedStatement st = c.prepareStatement("SELECT ?::bytea")) {
            st.setBytes(1, blob);
            try (ResultSet rs = st.executeQuery()) {
                rs.next();
                check("bytea: 16 MiB round trip", digest(rs.getBytes(1)), digest(blob));
            }
        }
    }

    /** What a check prints of a large value: its length and hash. */
    static String digest(byte[] data) throws Exception {
        return data.length + " " + HexFormat.of().formatHex(MessageDigest.getInstance("SHA-256").digest(data));
    }

    static ThreadFactory daemon() {
        return r -> {
            Thread t = new Thread(r);
            t.setDaemon(true); // a stuck call cannot hold the exit
            return t;
        };
    }

    public static void main(String[] args) {
        Map<String, Scenario> scenarios = new LinkedHashMap<>();
        scenarios.put("seed", CheckPgjdbc::seed);
        scenarios.put("startup_options", CheckPgjdbc::startupOptions);
        scenarios.put("no_token", CheckPgjdbc::noToken);
        scenarios.put("aborted_transaction", CheckPgjdbc::abortedTransaction);
        scenarios.put("batch", CheckPgjdbc::batch);
        scenarios.put("multi_statement", CheckPgjdbc::multiStatement);
        scenarios.put("copy", CheckPgjdbc::copy);
        scenarios.put("cancel", CheckPgjdbc::cancel);
        scenarios.put("listen_notify", CheckPgjdbc::listenNotify);
        scenarios.put("bytea", CheckPgjdbc::bytea);
        ExecutorService runner = Executors.newSingleThreadExecutor(daemon());
        for (var scenario : scenarios.entrySet()) {
            try {
                runner.submit(() -> { scenario.getValue().run(); return null; })
                        .get(SCENARIO_TIMEOUT_S, TimeUnit.SECONDS);
            } catch (TimeoutException e) {
                System.out.println("FAIL " + scenario.getKey() + ": did not finish within " + SCENARIO_TIMEOUT_S + " s");
                System.exit(1);
            } catch (Exception e) {
                Throwable cause = e instanceof ExecutionException ? e.getCause() : e;
                System.out.println("FAIL " + scenario.getKey() + ": "
                        + (cause instanceof Mismatch ? cause.getMessage() : cause.toString()));
                System.exit(1);
            }
        }
        System.out.println("ok " + checks + " checks");
        System.exit(0);
    }
}
