package dev.effectively.peer;

import com.fasterxml.jackson.databind.JsonNode;
import com.fasterxml.jackson.databind.ObjectMapper;
import java.io.IOException;
import java.time.Instant;
import java.time.OffsetDateTime;
import java.time.ZoneOffset;
import java.util.HashMap;
import java.util.Map;
import java.util.UUID;
import org.apache.flink.api.common.JobStatus;
import org.apache.flink.api.common.eventtime.WatermarkStrategy;
import org.apache.flink.api.common.typeinfo.TypeInformation;
import org.apache.flink.configuration.Configuration;
import org.apache.flink.connector.jdbc.JdbcExactlyOnceOptions;
import org.apache.flink.connector.jdbc.JdbcExecutionOptions;
import org.apache.flink.connector.jdbc.JdbcSink;
import org.apache.flink.connector.jdbc.JdbcStatementBuilder;
import org.apache.flink.connector.kafka.source.KafkaSource;
import org.apache.flink.connector.kafka.source.enumerator.initializer.OffsetsInitializer;
import org.apache.flink.connector.kafka.source.reader.deserializer.KafkaRecordDeserializationSchema;
import org.apache.flink.core.execution.JobClient;
import org.apache.flink.streaming.api.environment.StreamExecutionEnvironment;
import org.apache.flink.util.Collector;
import org.apache.flink.util.function.SerializableSupplier;
import org.apache.kafka.clients.consumer.ConsumerRecord;
import org.postgresql.xa.PGXADataSource;

/**
 * The Flink peer of `loadgen bench` (its `flink` phase): a Kafka topic of loadgen's payments
 * upserted by event id into a PostgreSQL table through Flink's exactly-once JDBC sink, on Flink's
 * local MiniCluster in this one JVM.
 *
 * <p>Exactly-once here is Flink's two-phase commit over XA: each sink subtask writes into one XA
 * transaction per checkpoint ({@code PREPARE TRANSACTION} when the checkpoint's barrier passes,
 * {@code COMMIT PREPARED} once the checkpoint is complete), so an effect becomes visible one
 * checkpoint after it was written, and a restore from a checkpoint commits what that checkpoint
 * prepared and rolls back what came after it.
 *
 * <p>The table is created by loadgen: {@code event_id uuid PRIMARY KEY}, the payment's fields,
 * {@code kafka_ts} (the record's timestamp, for the latency) and {@code applied} (how many
 * records of the event were applied: a resend counts 2, a record applied twice counts once too
 * many, which is what the bench's crash run looks for).
 *
 * <p>Arguments, {@code key=value}: brokers, topic, group, jdbc-url, user, table,
 * checkpoint-interval-ms, checkpoint-dir (absolute), parallelism, and restore-from (a retained
 * checkpoint's directory, optional); the password in {@code PEER_JDBC_PASSWORD}. Prints
 * {@code RUNNING <job id>} once the job runs; exits non-zero if the job fails (no restart
 * strategy: the bench wants a failure, not a retry loop).
 */
public final class FlinkXaPeer {

    /** Debezium's JDBC sink (the Connect peer) upserts every column; so does this, plus the count. */
    static final String UPSERT =
            "INSERT INTO %s (event_id, payment_id, user_id, amount_paise, occurred_at, kafka_ts)"
                    + " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (event_id) DO UPDATE SET"
                    + " payment_id = EXCLUDED.payment_id, user_id = EXCLUDED.user_id,"
                    + " amount_paise = EXCLUDED.amount_paise, occurred_at = EXCLUDED.occurred_at,"
                    + " kafka_ts = EXCLUDED.kafka_ts, applied = %s.applied + 1";

    private FlinkXaPeer() {}

    public static void main(String[] argv) throws Exception {
        Map<String, String> args = parse(argv);
        String table = required(args, "table");
        if (!table.matches("[a-z_][a-z0-9_]*")) {
            throw new IllegalArgumentException("table must be a plain lower-case name: " + table);
        }
        int parallelism = Integer.parseInt(required(args, "parallelism"));

        Configuration conf = new Configuration();
        conf.setString("parallelism.default", String.valueOf(parallelism));
        conf.setString("execution.checkpointing.interval", required(args, "checkpoint-interval-ms") + " ms");
        conf.setString("execution.checkpointing.mode", "EXACTLY_ONCE");
        conf.setString("execution.checkpointing.dir", "file://" + required(args, "checkpoint-dir"));
        // Kept when the job is cancelled or its process killed: the bench restores from it.
        conf.setString("execution.checkpointing.externalized-checkpoint-retention", "RETAIN_ON_CANCELLATION");
        conf.setString("restart-strategy.type", "none");
        if (args.containsKey("restore-from")) {
            conf.setString("execution.state-recovery.path", args.get("restore-from"));
        }
        StreamExecutionEnvironment env = StreamExecutionEnvironment.getExecutionEnvironment(conf);

        KafkaSource<Payment> source =
                KafkaSource.<Payment>builder()
                        .setBootstrapServers(required(args, "brokers"))
                        .setTopics(required(args, "topic"))
                        .setGroupId(required(args, "group"))
                        // Only for a fresh start: a restored job reads from its checkpoint's offsets.
                        .setStartingOffsets(OffsetsInitializer.earliest())
                        .setDeserializer(new PaymentDeserializer())
                        .build();

        String url = required(args, "jdbc-url");
        String user = required(args, "user");
        // From the environment: a command line is visible to every user of the machine.
        String password = System.getenv().getOrDefault("PEER_JDBC_PASSWORD", "");
        SerializableSupplier<javax.sql.XADataSource> xa =
                () -> {
                    PGXADataSource ds = new PGXADataSource();
                    ds.setUrl(url);
                    ds.setUser(user);
                    ds.setPassword(password);
                    return ds;
                };
        JdbcStatementBuilder<Payment> bind =
                (ps, p) -> {
                    ps.setObject(1, UUID.fromString(p.eventId));
                    ps.setString(2, p.paymentId);
                    ps.setString(3, p.userId);
                    ps.setLong(4, p.amountPaise);
                    ps.setObject(5, OffsetDateTime.parse(p.occurredAt));
                    ps.setObject(6, OffsetDateTime.ofInstant(Instant.ofEpochMilli(p.kafkaTs), ZoneOffset.UTC));
                };

        env.fromSource(source, WatermarkStrategy.noWatermarks(), "payments")
                .uid("payments")
                .addSink(
                        JdbcSink.exactlyOnceSink(
                                String.format(UPSERT, table, table),
                                bind,
                                // maxRetries must be 0: a retried batch inside an XA transaction
                                // may double (FLINK-22311). Batch size: the connector's default.
                                JdbcExecutionOptions.builder().withMaxRetries(0).build(),
                                // PostgreSQL allows one XA transaction per connection.
                                JdbcExactlyOnceOptions.builder().withTransactionPerConnection(true).build(),
                                xa))
                .uid("xa-sink")
                .name("jdbc-xa-upsert");

        JobClient job = env.executeAsync("flink-xa-peer " + table);
        while (true) {
            JobStatus status = job.getJobStatus().get();
            if (status == JobStatus.RUNNING) {
                break;
            }
            if (status.isGloballyTerminalState()) {
                System.err.println("the job ended before it ran: " + status);
                System.exit(2);
            }
            Thread.sleep(20);
        }
        System.out.println("RUNNING " + job.getJobID());
        System.out.flush();
        try {
            job.getJobExecutionResult().get();
        } catch (Exception e) {
            e.printStackTrace();
            System.exit(1);
        }
    }

    private static Map<String, String> parse(String[] argv) {
        Map<String, String> m = new HashMap<>();
        for (String a : argv) {
            int eq = a.indexOf('=');
            if (eq <= 0) {
                throw new IllegalArgumentException("arguments are key=value: " + a);
            }
            m.put(a.substring(0, eq), a.substring(eq + 1));
        }
        return m;
    }

    private static String required(Map<String, String> args, String key) {
        String v = args.get(key);
        if (v == null || v.isEmpty()) {
            throw new IllegalArgumentException("missing " + key + "=...");
        }
        return v;
    }

    /** One payment as loadgen writes it, with its record's timestamp. A Flink POJO. */
    public static final class Payment {
        public String eventId;
        public String paymentId;
        public String userId;
        public long amountPaise;
        public String occurredAt;
        public long kafkaTs;

        public Payment() {}
    }

    /**
     * The record's JSON payment. A record that is not one fails the job: the bench's topics hold
     * none, and a peer that skipped what it cannot read would hide a lost effect.
     */
    static final class PaymentDeserializer implements KafkaRecordDeserializationSchema<Payment> {
        private static final long serialVersionUID = 1L;
        private transient ObjectMapper json;

        @Override
        public void deserialize(ConsumerRecord<byte[], byte[]> record, Collector<Payment> out)
                throws IOException {
            if (json == null) {
                json = new ObjectMapper();
            }
            JsonNode doc = json.readTree(record.value());
            Payment p = new Payment();
            p.eventId = text(doc, "event_id", record);
            p.paymentId = text(doc, "payment_id", record);
            p.userId = text(doc, "user_id", record);
            JsonNode amount = doc.get("amount_paise");
            if (amount == null || !amount.canConvertToLong()) {
                throw new IOException(where(record) + ": amount_paise is not a whole number");
            }
            p.amountPaise = amount.asLong();
            p.occurredAt = text(doc, "occurred_at", record);
            p.kafkaTs = record.timestamp();
            out.collect(p);
        }

        private static String text(JsonNode doc, String field, ConsumerRecord<?, ?> record)
                throws IOException {
            JsonNode v = doc == null ? null : doc.get(field);
            if (v == null || !v.isTextual()) {
                throw new IOException(where(record) + ": no text field " + field);
            }
            return v.asText();
        }

        private static String where(ConsumerRecord<?, ?> record) {
            return record.topic() + "/" + record.partition() + "@" + record.offset();
        }

        @Override
        public TypeInformation<Payment> getProducedType() {
            return TypeInformation.of(Payment.class);
        }
    }
}
